"""A caller's own Vulkan: pagedvk on a VkDevice, VkBuffers and VkCommandBuffers that a program made itself through
the raw `vulkan` package (Device.from_handles, DeviceArray.from_buffer, record_into), checked against float64, in a
fresh process under the validation layer where it is installed (which would report pagedvk objects left on the
caller's device when the caller destroys it)."""

import pytest

from support import program, run_python
from test_crashes_limits_and_peer_calls import layer_findings, passed, validation_layer_installed

CALLER = """
import numpy as np, vulkan as vk, pagedvk
from pagedvk.testing import reference

# -- the caller's Vulkan: instance, device, queue, buffers, command pool --------------------------------------------
app = vk.VkApplicationInfo(sType=vk.VK_STRUCTURE_TYPE_APPLICATION_INFO, apiVersion=vk.VK_MAKE_VERSION(1, 3, 0))
instance = vk.vkCreateInstance(vk.VkInstanceCreateInfo(sType=vk.VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO,
                                                       pApplicationInfo=app), None)
pd = vk.vkEnumeratePhysicalDevices(instance)[0]
family = next(i for i, f in enumerate(vk.vkGetPhysicalDeviceQueueFamilyProperties(pd))
              if f.queueFlags & vk.VK_QUEUE_COMPUTE_BIT)
handle = vk.vkCreateDevice(pd, vk.VkDeviceCreateInfo(
    sType=vk.VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO, queueCreateInfoCount=1, pQueueCreateInfos=[vk.VkDeviceQueueCreateInfo(
        sType=vk.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO, queueFamilyIndex=family, queueCount=1,
        pQueuePriorities=[1.0])]), None)
queue = vk.vkGetDeviceQueue(handle, family, 0)
memory_types = vk.vkGetPhysicalDeviceMemoryProperties(pd)
made = []

def caller_buffer(data):
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    size = max(16, -(-raw.nbytes // 16) * 16)
    usage = (vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
             | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT)
    buffer = vk.vkCreateBuffer(handle, vk.VkBufferCreateInfo(sType=vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, size=size,
                               usage=usage, sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE), None)
    needs = vk.vkGetBufferMemoryRequirements(handle, buffer)
    want = vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
    kind = next(i for i in range(memory_types.memoryTypeCount) if needs.memoryTypeBits & (1 << i)
                and memory_types.memoryTypes[i].propertyFlags & want == want)
    memory = vk.vkAllocateMemory(handle, vk.VkMemoryAllocateInfo(sType=vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
                                 allocationSize=needs.size, memoryTypeIndex=kind), None)
    vk.vkBindBufferMemory(handle, buffer, memory, 0)
    mapped = vk.vkMapMemory(handle, memory, 0, needs.size, 0)
    mapped[:raw.nbytes] = raw.tobytes()
    made.append((buffer, memory))
    return buffer, mapped, size

pool = vk.vkCreateCommandPool(handle, vk.VkCommandPoolCreateInfo(sType=vk.VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO,
                              queueFamilyIndex=family), None)

def submit(record):
    cb = vk.vkAllocateCommandBuffers(handle, vk.VkCommandBufferAllocateInfo(
        sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO, commandPool=pool,
        level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1))[0]
    vk.vkBeginCommandBuffer(cb, vk.VkCommandBufferBeginInfo(sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO))
    recorded = record(cb)
    vk.vkEndCommandBuffer(cb)
    fence = vk.vkCreateFence(handle, vk.VkFenceCreateInfo(sType=vk.VK_STRUCTURE_TYPE_FENCE_CREATE_INFO), None)
    vk.vkQueueSubmit(queue, 1, [vk.VkSubmitInfo(sType=vk.VK_STRUCTURE_TYPE_SUBMIT_INFO, commandBufferCount=1,
                                                pCommandBuffers=[cb])], fence)
    vk.vkWaitForFences(handle, 1, [fence], vk.VK_TRUE, 60 * 10**9)
    vk.vkDestroyFence(handle, fence, None)
    vk.vkFreeCommandBuffers(handle, pool, 1, [cb])
    recorded.close()

# -- pagedvk on it --------------------------------------------------------------------------------------------------
device = pagedvk.Device.from_handles(pd, handle, family, instance=instance)
print("opened", device, flush=True)
rng = np.random.default_rng(0)
k = rng.standard_normal((6, 2, 8, 16, 4)).astype(np.float32)
v = rng.standard_normal((6, 2, 32, 16)).astype(np.float32)
q = rng.standard_normal((2, 4, 32)).astype(np.float32)
tables, lens = np.array([[0, 2, 4], [1, 3, -1]], np.int32), np.array([40, 30], np.int32)
arrays = {}
for name, data in (("q", q), ("k", k), ("v", v), ("out", np.full(q.shape, np.nan, np.float32))):
    buffer, mapped, size = caller_buffer(data)
    arrays[name] = (pagedvk.DeviceArray.from_buffer(buffer, 0, data.shape, data.dtype, buffer_size=size,
                                                    device=device), mapped)
(dq, _), (dk, _), (dv, _), (dout, out_mapped) = arrays.values()
read_out = lambda: np.frombuffer(out_mapped[:q.nbytes], np.float32).reshape(q.shape).copy()
expected = reference.paged_attention(q, k, v, tables, lens)
error = lambda got: np.linalg.norm(got - expected) / np.linalg.norm(expected)

plan = pagedvk.DecodePlan(tables, lens, num_heads=4, num_kv_heads=2, head_size=32, block_size=16, num_blocks=6,
                          device=device)
submit(lambda cb: plan.record_into(cb, dq, dk, dv, dout))          # into the caller's command buffer
assert error(read_out()) < 1e-5, error(read_out())
print("recorded into the caller's command buffer", flush=True)

dout.write(np.full(q.shape, np.nan, np.float32))                    # pagedvk's own copy into the caller's buffer
assert np.isnan(read_out()).all()
assert plan.run(dq, dk, dv, out=dout) is dout                       # queued on pagedvk's stream, the caller's queue
assert error(dout.numpy()) < 1e-5

# A recorded step (a cache write, then the attention that reads it) recorded into the caller's command buffer.
new_k, new_v = rng.standard_normal((2, 2, 2, 32)).astype(np.float32)
slots = pagedvk.asarray(np.array([2 * 16 + 8, 3 * 16 + 14], np.int32), device)   # each sequence's last token
nk, nv = pagedvk.asarray(new_k, device), pagedvk.asarray(new_v, device)
with pagedvk.record(device) as step:
    pagedvk.reshape_and_cache(nk, nv, dk, dv, slots)
    plan.run(dq, dk, dv, out=dout)
submit(step.record_into)
k2, v2 = reference.reshape_and_cache(new_k, new_v, k, v, [2 * 16 + 8, 3 * 16 + 14])
expected = reference.paged_attention(q, k2, v2, tables, lens)
assert error(read_out()) < 1e-5, error(read_out())

for a in (dq, dk, dv, dout, slots, nk, nv):
    a.close()
step.close()
plan.close()
device.close()
for buffer, memory in made:
    vk.vkDestroyBuffer(handle, buffer, None)
    vk.vkFreeMemory(handle, memory, None)
vk.vkDestroyCommandPool(handle, pool, None)
vk.vkDestroyDevice(handle, None)                                    # the layer reports objects pagedvk left on it
vk.vkDestroyInstance(instance, None)
print("ok")
"""


def test_pagedvk_on_a_callers_device_buffers_and_command_buffers():
    layers = dict(VK_INSTANCE_LAYERS="VK_LAYER_KHRONOS_validation") if validation_layer_installed() else {}
    result = run_python(program(CALLER), PYTHONFAULTHANDLER="1", **layers)
    output = result.stdout + result.stderr
    assert passed(result) and not layer_findings(output), output[-4000:]


def test_bad_handles_are_refused_by_name(device):
    import pagedvk
    with pytest.raises(TypeError, match="a VkPhysicalDevice must be the vulkan package's handle or an int, got str"):
        pagedvk.Device.from_handles("gpu0", 0, 0)
    with pytest.raises(ValueError, match="buffer_size must be an int of at least 16 bytes"):
        pagedvk.DeviceArray.from_buffer(1234, 0, (4,), "float32", buffer_size=8, device=device)

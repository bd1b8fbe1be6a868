#!/usr/bin/env python3
"""What the driver made of each module: its own statistics (registers, shared memory, local memory, ...)
through VK_KHR_pipeline_executable_properties, where the device has it (NVIDIA's driver does; Mesa 22.3's
lavapipe does not). Registers a thread bound how many workgroups a compute unit holds, and local memory
means arrays or spills the compiler put in memory: the first things to read when a kernel is slower than
its loads explain.

    python benchmarks/pipeline_stats.py paged_decode.kv_f16.glsl      # modules by name (pagedvk/spv)
    python benchmarks/pipeline_stats.py --no-variants paged_decode.kv_f16.glsl
    python benchmarks/pipeline_stats.py --no-variants --spec 1=1 --spec 2=4 paged_decode.kv_f16.glsl
    python benchmarks/pipeline_stats.py path/to/module.spv                          # or any SPIR-V file

The device is PAGEDVK_DEVICE's, or the one pagedvk would pick. --no-variants specializes VARIANTS false where a
module declares it (AttentionSpec.VARIANTS, the attention kernels' shared id), as launches without attention variants
run. NVIDIA's driver reports local memory as 2^36 plus the bytes a thread uses; the script prints both.
"""

import argparse
import sys
from pathlib import Path

import vulkan as vk

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pagedvk  # noqa: E402
from pagedvk.kernels import modules, spirv  # noqa: E402
from pagedvk.kernels.catalogue import AttentionSpec
from pagedvk.runtime.instance import get_instance  # noqa: E402
from pagedvk.runtime.pipeline import specialization_info  # noqa: E402

EXTENSION = "VK_KHR_pipeline_executable_properties"
STAGE = vk.VK_SHADER_STAGE_COMPUTE_BIT
NVIDIA_LOCAL_BASE = 1 << 36


def open_device(physical):
    """A logical device with the extension and its feature on (pagedvk's own devices do not enable it)."""
    names = {e.extensionName for e in vk.vkEnumerateDeviceExtensionProperties(physical, None)}
    if EXTENSION not in names:
        raise SystemExit(f"this device's driver does not offer {EXTENSION}: no statistics to read")
    feature = vk.VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR(
        sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PIPELINE_EXECUTABLE_PROPERTIES_FEATURES_KHR,
        pipelineExecutableInfo=vk.VK_TRUE)
    queue = vk.VkDeviceQueueCreateInfo(sType=vk.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO, queueFamilyIndex=0,
                                       queueCount=1, pQueuePriorities=[1.0])
    return vk.vkCreateDevice(physical, vk.VkDeviceCreateInfo(
        sType=vk.VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO, pNext=feature, queueCreateInfoCount=1,
        pQueueCreateInfos=[queue], enabledExtensionCount=1, ppEnabledExtensionNames=[EXTENSION]), None)


def statistics(device, code: bytes, specialization: dict) -> list:
    """[(name, value)] of every executable of a compute pipeline made from `code`."""
    r = spirv.reflect(code)
    set_layout = vk.vkCreateDescriptorSetLayout(device, vk.VkDescriptorSetLayoutCreateInfo(
        sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO, bindingCount=len(r.bindings),
        pBindings=[vk.VkDescriptorSetLayoutBinding(binding=b.binding, descriptorType=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                                   descriptorCount=1, stageFlags=STAGE) for b in r.bindings]), None)
    ranges = [vk.VkPushConstantRange(stageFlags=STAGE, offset=0, size=r.push_constant_size)] if r.push_constant_size else []
    layout = vk.vkCreatePipelineLayout(device, vk.VkPipelineLayoutCreateInfo(
        sType=vk.VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO, setLayoutCount=1, pSetLayouts=[set_layout],
        pushConstantRangeCount=len(ranges), pPushConstantRanges=ranges or None), None)
    module = vk.vkCreateShaderModule(device, vk.VkShaderModuleCreateInfo(
        sType=vk.VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO, codeSize=len(code), pCode=code), None)
    stage = vk.VkPipelineShaderStageCreateInfo(
        sType=vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO, stage=STAGE, module=module, pName="main",
        pSpecializationInfo=specialization_info(specialization))
    pipeline = vk.vkCreateComputePipelines(device, None, 1, [vk.VkComputePipelineCreateInfo(
        sType=vk.VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO,
        flags=vk.VK_PIPELINE_CREATE_CAPTURE_STATISTICS_BIT_KHR, stage=stage, layout=layout)], None)[0]
    properties = vk.vkGetDeviceProcAddr(device, "vkGetPipelineExecutablePropertiesKHR")
    stats = vk.vkGetDeviceProcAddr(device, "vkGetPipelineExecutableStatisticsKHR")
    formats = {vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_BOOL32_KHR: "b32",
               vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_INT64_KHR: "i64",
               vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_UINT64_KHR: "u64",
               vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_FLOAT64_KHR: "f64"}
    found = []
    try:
        executables = list(properties(device, vk.VkPipelineInfoKHR(sType=vk.VK_STRUCTURE_TYPE_PIPELINE_INFO_KHR,
                                                                   pipeline=pipeline)))
        for i in range(len(executables)):
            for s in stats(device, vk.VkPipelineExecutableInfoKHR(
                    sType=vk.VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_INFO_KHR, pipeline=pipeline, executableIndex=i)):
                found.append((s.name, getattr(s.value, formats[s.format])))
    finally:
        vk.vkDestroyPipeline(device, pipeline, None)
        vk.vkDestroyShaderModule(device, module, None)
        vk.vkDestroyPipelineLayout(device, layout, None)
        vk.vkDestroyDescriptorSetLayout(device, set_layout, None)
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("modules", nargs="+", help="module names (as in pagedvk/spv, without .spv) or SPIR-V files")
    p.add_argument("--no-variants", action="store_true", help="specialize VARIANTS false where declared")
    p.add_argument("--spec", action="append", default=[], metavar="ID=VALUE",
                   help="set a specialization constant the module declares, e.g. the decode kernel's layout and "
                        "head-group width as a plan sets them: --spec 1=1 --spec 2=4 (pagedvk/kernels/abi.py)")
    args = p.parse_args(argv)
    info, _ = pagedvk.select()
    physical = vk.vkEnumeratePhysicalDevices(get_instance().handle)[info.index]
    device = open_device(physical)
    try:
        print(f"{info.name} ({info.driver} {info.driver_version})")
        for name in args.modules:
            path = Path(name) if name.endswith(".spv") else modules.module_path(name)
            code = path.read_bytes()
            declared = AttentionSpec.VARIANTS in spirv.reflect(code).spec_constants
            spec = {AttentionSpec.VARIANTS: False} if args.no_variants and declared else {}
            spec.update({int(i): int(v) for i, v in (item.split("=") for item in args.spec)})
            shown = []
            for stat, value in statistics(device, code, spec):
                if stat == "Local Memory Size" and isinstance(value, int) and value >= NVIDIA_LOCAL_BASE:
                    value = f"{value} (2^36 + {value - NVIDIA_LOCAL_BASE})"
                shown.append(f"{stat} {value}")
            print(f"{path.stem}{f' {spec}' if spec else ''}: " + "; ".join(shown), flush=True)
    finally:
        vk.vkDestroyDevice(device, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())

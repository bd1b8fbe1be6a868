"""The Vulkan instance, the validation layer, and what each physical device offers."""

from __future__ import annotations

import atexit
import sys
import threading
from dataclasses import dataclass, field

import vulkan as vk

from .. import config

from ..errors import ClosedError, PagedVKError, ValidationError, VulkanError

VALIDATION_LAYER = "VK_LAYER_KHRONOS_validation"
# The first Vulkan header that knows VK_KHR_cooperative_matrix (1.3.255). A validation layer built from an older
# one (Debian 12's is 1.3.239) reports the extension's structures at device creation as invalid, so under such a
# layer pagedvk leaves cooperative matrices off (pagedvk.runtime.device) and the prefill runs its scalar kernel.
MATRIX_AWARE_LAYER = vk.VK_MAKE_VERSION(1, 3, 255)


# VK_KHR_shader_bfloat16 (the bfloat16 cooperative-matrix modules): a layer from before its release (1.4.311), or
# before the layer reported bfloat16 matrix types (1.4.321), would refuse or misreport them; under such a layer the
# bfloat16 kernels stay on their scalar modules.
BFLOAT16_EXTENSION = "VK_KHR_shader_bfloat16"
BFLOAT16_AWARE_LAYER = vk.VK_MAKE_VERSION(1, 4, 321)


class Bfloat16Features:
    """VkPhysicalDeviceShaderBfloat16FeaturesKHR, laid out by hand: the `vulkan` package's headers (1.3.275)
    predate VK_KHR_shader_bfloat16. sType (4 bytes, then padding), pNext (8), then the VkBool32s
    shaderBFloat16Type, shaderBFloat16DotProduct and shaderBFloat16CooperativeMatrix."""

    STRUCTURE_TYPE = 1000141000   # VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_BFLOAT16_FEATURES_KHR

    def __init__(self, p_next=None, type_: bool = False, matrix: bool = False):
        self.words = vk.ffi.new("uint32_t[8]")
        self.words[0] = self.STRUCTURE_TYPE
        vk.ffi.cast("void **", self.words + 2)[0] = vk.ffi.NULL if p_next is None else p_next
        self.words[4], self.words[6] = int(type_), int(matrix)

    @property
    def pointer(self):
        """For a pNext chain (this object must outlive the call that reads it)."""
        return vk.ffi.cast("void *", self.words)

    @property
    def type(self) -> bool:
        return bool(self.words[4])

    @property
    def matrix(self) -> bool:
        return bool(self.words[6])


def layer_knows_bfloat16(spec_version: int) -> bool:
    return spec_version >= BFLOAT16_AWARE_LAYER


def layer_knows_cooperative_matrix(spec_version: int) -> bool:
    """Whether a layer of this specVersion (VkLayerProperties) was built with VK_KHR_cooperative_matrix's
    structures (the patch number is the header version)."""
    return spec_version >= MATRIX_AWARE_LAYER


DEVICE_TYPES = {
    vk.VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU: "discrete",
    vk.VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU: "integrated",
    vk.VK_PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU: "virtual",
    vk.VK_PHYSICAL_DEVICE_TYPE_CPU: "cpu",
    vk.VK_PHYSICAL_DEVICE_TYPE_OTHER: "other",
}
# default_device() prefers earlier entries
TYPE_PREFERENCE = ("discrete", "integrated", "virtual", "cpu", "other")
VENDORS = {0x1002: "AMD", 0x1010: "ImgTec", 0x10DE: "NVIDIA", 0x13B5: "ARM", 0x5143: "Qualcomm",
           0x8086: "Intel", 0x106B: "Apple", 0x10005: "Mesa"}


# VkComponentTypeKHR and VkScopeKHR as short names; bfloat16 is VK_KHR_shader_bfloat16's, newer than the
# `vulkan` package's headers.
COMPONENT_TYPES = {
    vk.VK_COMPONENT_TYPE_FLOAT16_KHR: "f16", vk.VK_COMPONENT_TYPE_FLOAT32_KHR: "f32",
    vk.VK_COMPONENT_TYPE_FLOAT64_KHR: "f64", 1000141000: "bf16",
    vk.VK_COMPONENT_TYPE_SINT8_KHR: "s8", vk.VK_COMPONENT_TYPE_SINT16_KHR: "s16",
    vk.VK_COMPONENT_TYPE_SINT32_KHR: "s32", vk.VK_COMPONENT_TYPE_SINT64_KHR: "s64",
    vk.VK_COMPONENT_TYPE_UINT8_KHR: "u8", vk.VK_COMPONENT_TYPE_UINT16_KHR: "u16",
    vk.VK_COMPONENT_TYPE_UINT32_KHR: "u32", vk.VK_COMPONENT_TYPE_UINT64_KHR: "u64",
}
SCOPES = {vk.VK_SCOPE_DEVICE_KHR: "device", vk.VK_SCOPE_WORKGROUP_KHR: "workgroup",
          vk.VK_SCOPE_SUBGROUP_KHR: "subgroup", vk.VK_SCOPE_QUEUE_FAMILY_KHR: "queue_family"}
COOPERATIVE_MATRIX_EXTENSION = "VK_KHR_cooperative_matrix"


@dataclass(frozen=True)
class MatrixShape:
    """One cooperative-matrix multiply a device offers (VkCooperativeMatrixPropertiesKHR): result (m x n) =
    a (m x k) * b (k x n) + c, element types as short names ("f16", "f32", "bf16", "s8", ...)."""

    m: int
    n: int
    k: int
    a: str
    b: str
    c: str
    result: str
    scope: str = "subgroup"
    saturating: bool = False

    def __str__(self) -> str:
        return f"{self.m}x{self.n}x{self.k} {self.a}*{self.b}+{self.c}->{self.result} ({self.scope})"


def matrix_shapes(instance, pd, extensions) -> tuple:
    """The cooperative-matrix multiplies the device lists; () without VK_KHR_cooperative_matrix, or without the
    VkInstance `pd` came from (None: a caller's device described without its instance)."""
    if COOPERATIVE_MATRIX_EXTENSION not in extensions or instance is None:
        return ()
    name = b"vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR"
    address = vk.lib.vkGetInstanceProcAddr(instance, name)
    if address == vk.ffi.NULL:
        return ()
    # Called through cffi directly: the package's wrapper leaves each output struct's sType unset.
    query = vk.ffi.cast("PFN_vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR", address)
    count = vk.ffi.new("uint32_t*")
    check(query(pd, count, vk.ffi.NULL), "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR")
    props = vk.ffi.new("VkCooperativeMatrixPropertiesKHR[]", count[0])
    for i in range(count[0]):
        props[i].sType = vk.VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_PROPERTIES_KHR
    check(query(pd, count, props), "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR")
    kind = lambda t: COMPONENT_TYPES.get(t, f"type{t}")
    return tuple(MatrixShape(p.MSize, p.NSize, p.KSize, kind(p.AType), kind(p.BType), kind(p.CType),
                             kind(p.ResultType), SCOPES.get(p.scope, f"scope{p.scope}"), bool(p.saturatingAccumulation))
                 for p in props[0:count[0]])


def version_string(v: int) -> str:
    return f"{vk.VK_VERSION_MAJOR(v)}.{vk.VK_VERSION_MINOR(v)}.{vk.VK_VERSION_PATCH(v)}"


def check(result: int, what: str) -> None:
    if result != vk.VK_SUCCESS:
        raise VulkanError(f"{what} failed with VkResult {result}", result)


@dataclass(frozen=True)
class DeviceInfo:
    """What one physical device is and offers; `pagedvk.devices()` returns one per device.

    Attributes
    ----------
    index : int
        The device's place in Vulkan's list (what PAGEDVK_DEVICE and `select` take).
    name, type, vendor, driver, driver_version, api_version : str
        type is "discrete", "integrated", "virtual", "cpu" or "other".
    device_local_bytes : int
        The size of the device-local heaps.
    subgroup_size : int
    fp16, storage16, storage8, bf16, cooperative_matrix : bool
        shaderFloat16 arithmetic, 16-bit and 8-bit storage buffer access, VK_KHR_shader_bfloat16,
        VK_KHR_cooperative_matrix.
    max_storage_buffer_range, max_allocation_bytes, min_storage_buffer_offset_alignment : int
        The limits that decide how device arrays are split and bound.
    max_texel_buffer_elements, min_texel_buffer_offset_alignment : int
        Where a kernel binds an array as a storage texel buffer (Binding.texels): its texels at most, and where it
        may start.
    max_workgroup_count : tuple of int
        maxComputeWorkGroupCount: workgroups per grid dimension.
    compute_units : int
        SMs / CUs where the driver says, else 0.
    extensions : frozenset of str
    subgroup_arithmetic, subgroup_shuffle, subgroup_vote : bool
        The subgroup operations compute shaders may use.
    max_shared_memory : int
        maxComputeSharedMemorySize in bytes.
    matrix_shapes : tuple of MatrixShape
        The cooperative-matrix multiplies the device lists; () without VK_KHR_cooperative_matrix.
    handle
        The VkPhysicalDevice.
    """

    index: int
    name: str
    type: str
    vendor: str
    driver: str
    driver_version: str
    api_version: str
    device_local_bytes: int
    subgroup_size: int
    fp16: bool               # shaderFloat16 arithmetic
    storage16: bool          # 16-bit storage buffer access
    storage8: bool           # 8-bit storage buffer access
    bf16: bool               # VK_KHR_shader_bfloat16
    cooperative_matrix: bool  # VK_KHR_cooperative_matrix
    max_storage_buffer_range: int
    max_allocation_bytes: int
    min_storage_buffer_offset_alignment: int   # where a bound sub-range of a buffer may start
    max_workgroup_count: tuple   # maxComputeWorkGroupCount: workgroups per grid dimension
    compute_units: int           # SMs / CUs where the driver says (VK_NV_shader_sm_builtins,
                                 # VK_AMD_shader_core_properties), else 0 (see decode_rules.partitioning)
    extensions: frozenset = field(repr=False)
    # subgroupAdd/Max in compute shaders (VK_SUBGROUP_FEATURE_ARITHMETIC_BIT), optional in Vulkan: the decode
    # kernel's reductions use it where present (KernelABI.subgroup_reduce)
    subgroup_arithmetic: bool = True
    # subgroupShuffle in compute shaders (VK_SUBGROUP_FEATURE_SHUFFLE_BIT): the CPU decode kernel needs it
    subgroup_shuffle: bool = True
    # subgroupAny in compute shaders (VK_SUBGROUP_FEATURE_VOTE_BIT): the cooperative-matrix decode needs it
    subgroup_vote: bool = True
    # maxTexelBufferElements and minTexelBufferOffsetAlignment (Vulkan guarantees 65536 and allows up to 256)
    max_texel_buffer_elements: int = 65536
    min_texel_buffer_offset_alignment: int = 256
    # maxComputeSharedMemorySize: bytes of workgroup memory a compute shader may declare (Vulkan guarantees 16 KiB;
    # the WGSL prefill forward needs more: catalogue.PREFILL_WGSL_SHARED_BYTES)
    max_shared_memory: int = 16384
    # VK_KHR_cooperative_matrix's multiplies (MatrixShape), () without it
    matrix_shapes: tuple = field(default=(), repr=False)
    handle: object = field(default=None, repr=False, compare=False)  # VkPhysicalDevice

    def __str__(self) -> str:
        return f"[{self.index}] {self.name} ({self.type}, {self.driver})"


class Instance:
    """The process-wide VkInstance; with PAGEDVK_VALIDATION=1 it carries the Khronos validation layer."""

    def __init__(self, validation: bool):
        self.validation = validation
        self.messages: list[str] = []  # validation messages not yet raised
        self._lock = threading.Lock()
        self._messenger = None
        layers, extensions = [], []
        available_exts = {e.extensionName for e in vk.vkEnumerateInstanceExtensionProperties(None)}
        if "VK_KHR_portability_enumeration" in available_exts:  # MoltenVK lists itself only when asked
            extensions.append("VK_KHR_portability_enumeration")
        self.layer_version = 0   # the validation layer's specVersion, when it is on
        if validation:
            found = {l.layerName: l.specVersion for l in vk.vkEnumerateInstanceLayerProperties()}
            if VALIDATION_LAYER not in found:
                raise PagedVKError(
                    f"PAGEDVK_VALIDATION=1 but {VALIDATION_LAYER} is not installed "
                    "(Debian/Ubuntu: apt-get install vulkan-validationlayers)")
            self.layer_version = found[VALIDATION_LAYER]
            layers.append(VALIDATION_LAYER)
            extensions.append(vk.VK_EXT_DEBUG_UTILS_EXTENSION_NAME)
        app = vk.VkApplicationInfo(
            sType=vk.VK_STRUCTURE_TYPE_APPLICATION_INFO, pApplicationName="pagedvk", applicationVersion=1,
            pEngineName="pagedvk", engineVersion=1, apiVersion=vk.VK_MAKE_VERSION(1, 2, 0))
        features = None
        if validation:
            self._enabled_features = vk.ffi.new(
                "VkValidationFeatureEnableEXT[1]",
                [vk.VK_VALIDATION_FEATURE_ENABLE_SYNCHRONIZATION_VALIDATION_EXT])
            features = vk.VkValidationFeaturesEXT(
                sType=vk.VK_STRUCTURE_TYPE_VALIDATION_FEATURES_EXT, enabledValidationFeatureCount=1,
                pEnabledValidationFeatures=self._enabled_features)
        info = vk.VkInstanceCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, pNext=features or vk.ffi.NULL,
            flags=(vk.VK_INSTANCE_CREATE_ENUMERATE_PORTABILITY_BIT_KHR
                   if "VK_KHR_portability_enumeration" in extensions else 0),
            pApplicationInfo=app, enabledLayerCount=len(layers), ppEnabledLayerNames=layers,
            enabledExtensionCount=len(extensions), ppEnabledExtensionNames=extensions)
        try:
            self.handle = vk.vkCreateInstance(info, None)
        except vk.VkError as e:
            raise VulkanError(f"vkCreateInstance failed ({type(e).__name__}): is a Vulkan driver installed? "
                              "(Debian/Ubuntu: apt-get install mesa-vulkan-drivers libvulkan1)") from e
        if validation:
            self._install_messenger()
        self._infos = None

    def _install_messenger(self) -> None:
        # cffi swallows exceptions raised inside callbacks, so the callback only records the message and
        # raise_validation_messages() raises it after the call that caused it returns.
        def callback(severity, types, data, user_data):
            msg = vk.ffi.string(data.pMessage).decode(errors="replace")
            with self._lock:
                self.messages.append(msg)
            return vk.VK_FALSE

        self._callback = callback
        create = vk.vkGetInstanceProcAddr(self.handle, "vkCreateDebugUtilsMessengerEXT")
        info = vk.VkDebugUtilsMessengerCreateInfoEXT(
            sType=vk.VK_STRUCTURE_TYPE_DEBUG_UTILS_MESSENGER_CREATE_INFO_EXT,
            messageSeverity=(vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_WARNING_BIT_EXT
                             | vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT),
            messageType=(vk.VK_DEBUG_UTILS_MESSAGE_TYPE_GENERAL_BIT_EXT
                         | vk.VK_DEBUG_UTILS_MESSAGE_TYPE_VALIDATION_BIT_EXT
                         | vk.VK_DEBUG_UTILS_MESSAGE_TYPE_PERFORMANCE_BIT_EXT),
            pfnUserCallback=callback)
        self._messenger = create(self.handle, info, None)

    def take_messages(self) -> list:
        with self._lock:
            messages, self.messages = self.messages, []
        return messages

    def raise_validation_messages(self) -> None:
        if self.messages:
            messages = self.take_messages()
            raise ValidationError("Vulkan validation: " + "\n".join(messages))

    def physical_devices(self) -> list:
        if self._infos is None:
            self._infos = [describe(i, pd, self.handle)
                           for i, pd in enumerate(vk.vkEnumeratePhysicalDevices(self.handle))]
        return self._infos

    def close(self) -> None:
        if self.handle is None:
            return
        if self._messenger is not None:
            vk.vkGetInstanceProcAddr(self.handle, "vkDestroyDebugUtilsMessengerEXT")(
                self.handle, self._messenger, None)
            self._messenger = None
        vk.vkDestroyInstance(self.handle, None)
        self.handle = None


def describe(index: int, pd, instance) -> DeviceInfo:
    props = vk.vkGetPhysicalDeviceProperties(pd)
    extensions = frozenset(e.extensionName for e in vk.vkEnumerateDeviceExtensionProperties(pd, None))
    subgroup = vk.VkPhysicalDeviceSubgroupProperties(sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES)
    driver = vk.VkPhysicalDeviceDriverProperties(
        sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_DRIVER_PROPERTIES, pNext=subgroup)
    maint3 = vk.VkPhysicalDeviceMaintenance3Properties(
        sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES, pNext=driver)
    chain = maint3
    sm = amd = None
    if "VK_NV_shader_sm_builtins" in extensions:
        chain = sm = vk.VkPhysicalDeviceShaderSMBuiltinsPropertiesNV(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_SM_BUILTINS_PROPERTIES_NV, pNext=chain)
    if "VK_AMD_shader_core_properties" in extensions:
        chain = amd = vk.VkPhysicalDeviceShaderCorePropertiesAMD(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_CORE_PROPERTIES_AMD, pNext=chain)
    props2 = vk.VkPhysicalDeviceProperties2(sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, pNext=chain)
    vk.vkGetPhysicalDeviceProperties2(pd, props2)
    compute_units = (sm.shaderSMCount if sm is not None else
                     amd.shaderEngineCount * amd.shaderArraysPerEngineCount * amd.computeUnitsPerShaderArray
                     if amd is not None else 0)
    f11, f12 = query_features(pd)
    memory = vk.vkGetPhysicalDeviceMemoryProperties(pd)
    local = sum(memory.memoryHeaps[i].size for i in range(memory.memoryHeapCount)
                if memory.memoryHeaps[i].flags & vk.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT)
    driver_name = vk.ffi.string(driver.driverName).decode(errors="replace") or "unknown"
    driver_info = vk.ffi.string(driver.driverInfo).decode(errors="replace")
    return DeviceInfo(
        index=index, name=props.deviceName, type=DEVICE_TYPES.get(props.deviceType, "other"),
        vendor=VENDORS.get(props.vendorID, f"0x{props.vendorID:04x}"), driver=driver_name,
        driver_version=driver_info or str(props.driverVersion), api_version=version_string(props.apiVersion),
        device_local_bytes=local, subgroup_size=subgroup.subgroupSize,
        subgroup_arithmetic=bool(subgroup.supportedOperations & vk.VK_SUBGROUP_FEATURE_ARITHMETIC_BIT
                                 and subgroup.supportedStages & vk.VK_SHADER_STAGE_COMPUTE_BIT),
        subgroup_shuffle=bool(subgroup.supportedOperations & vk.VK_SUBGROUP_FEATURE_SHUFFLE_BIT
                              and subgroup.supportedStages & vk.VK_SHADER_STAGE_COMPUTE_BIT),
        subgroup_vote=bool(subgroup.supportedOperations & vk.VK_SUBGROUP_FEATURE_VOTE_BIT
                           and subgroup.supportedStages & vk.VK_SHADER_STAGE_COMPUTE_BIT),
        fp16=bool(f12.shaderFloat16), storage16=bool(f11.storageBuffer16BitAccess),
        storage8=bool(f12.storageBuffer8BitAccess), bf16="VK_KHR_shader_bfloat16" in extensions,
        cooperative_matrix="VK_KHR_cooperative_matrix" in extensions,
        max_storage_buffer_range=props.limits.maxStorageBufferRange,
        max_allocation_bytes=maint3.maxMemoryAllocationSize,
        min_storage_buffer_offset_alignment=props.limits.minStorageBufferOffsetAlignment,
        max_workgroup_count=tuple(props.limits.maxComputeWorkGroupCount), compute_units=int(compute_units),
        max_shared_memory=int(props.limits.maxComputeSharedMemorySize),
        max_texel_buffer_elements=int(props.limits.maxTexelBufferElements),
        min_texel_buffer_offset_alignment=int(props.limits.minTexelBufferOffsetAlignment),
        extensions=extensions, matrix_shapes=matrix_shapes(instance, pd, extensions), handle=pd)


def query_features(pd, f11=None, f12=None, chain=None):
    """The Vulkan 1.1 and 1.2 feature structs of a device (filled in); pass structs to chain them, and in
    `chain` an extension's feature struct to fill in too."""
    f12 = f12 or vk.VkPhysicalDeviceVulkan12Features(sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES,
                                                     pNext=chain)
    f11 = f11 or vk.VkPhysicalDeviceVulkan11Features(
        sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES, pNext=f12)
    feats = vk.VkPhysicalDeviceFeatures2(sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, pNext=f11)
    vk.vkGetPhysicalDeviceFeatures2(pd, feats)
    return f11, f12


_instance: Instance | None = None
_instance_lock = threading.Lock()
_closers = []  # devices register here so they go before the instance at exit
_shut_down = False


def get_instance() -> Instance:
    global _instance
    with _instance_lock:
        if _shut_down:   # daemon threads still calling in after the exit hook: nothing new is made
            raise ClosedError("pagedvk has shut down (the interpreter is exiting)")
        if _instance is None:
            config.check_all()   # every PAGEDVK_* variable, before anything is made
            _instance = Instance(validation=config.validation())
        return _instance


def current_instance() -> Instance | None:
    """The instance if one was made (and not shut down), else None; unlike get_instance() it makes none. For
    reading what the validation layer reported (tests drain Instance.take_messages() around each test)."""
    return _instance


def register_closer(close) -> None:
    _closers.append(close)


@atexit.register
def _shutdown() -> None:
    """Close every device, then the instance. A device left open because its work still runs (close raised
    GPUTimeoutError) keeps the instance too: destroying it first would be invalid."""
    global _instance, _shut_down
    with _instance_lock:
        _shut_down = True
    for close in reversed(_closers):
        try:
            close()
        except Exception as e:   # noqa: BLE001 - the other devices still close; say why this one did not
            print(f"pagedvk: at exit: {e}", file=sys.stderr)
    abandoned = any(getattr(close.__self__, "abandoned", False) for close in _closers)
    _closers.clear()
    if _instance is not None and not abandoned:
        _instance.close()
        _instance = None

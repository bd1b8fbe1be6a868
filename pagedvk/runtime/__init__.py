"""Layer 1, the Vulkan runtime: the instance and its devices, memory, command submission, compute pipelines,
and the arrays that live on a device (DeviceArray) with the choice of device (selection). Above the base modules
(errors, config, dtypes) only; it knows nothing of kernels or ops."""

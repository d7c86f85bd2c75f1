"""CUDA lowering for the GPU schedules' kernels: tensor intrinsics (``mma16x8``,
``wgmma``, TVM's own registered by ``tensor_cores``), the build that lowers warp
fragments to registers (``tensor_cores.build``), and the passes it and the prefill build
run (``copy_waits``, ``cast_offsets``, ``software_pipeline``, ``async_prologue``,
``dependent_launch``, ``merged_tiles``, ``wgmma_batches``), with ``padding``, the
inlining of padded inputs into the kernels' loads."""

#: The mask of a warp's 32 lanes, for the shuffles every lane of a warp takes part in.
ALL_LANES = 0xFFFFFFFF


def sm_count(device) -> int:
    """``device``'s SMs (an H100/H200's where the device is not there to ask)."""
    return device.multi_processor_count if device.exist else 132

class MultiTensorApply:
    """Calls a multi-tensor op on lists of tensors. ``chunk_size`` is kept for apex's calling
    convention; apex-cpp's kernels pick their own chunks (65536 elements on the CPU and on CUDA)."""

    available = False
    warned = False

    def __init__(self, chunk_size):
        try:
            import amp_C  # noqa: F401  (the ops ship with the package: always there)
            MultiTensorApply.available = True
            self.chunk_size = chunk_size
        except ImportError as err:
            MultiTensorApply.available = False
            MultiTensorApply.import_err = err

    def check_avail(self):
        if not MultiTensorApply.available:
            raise RuntimeError("apex.multi_tensor_apply: amp_C failed to import: "
                               f"{MultiTensorApply.import_err}")

    def __call__(self, op, noop_flag_buffer, tensor_lists, *args):
        self.check_avail()
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)

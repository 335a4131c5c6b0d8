"""The Triton kernels for GPUs (triton imported only when they run): :mod:`.triton_attention` the forward and backward
launchers (kernels in :mod:`._triton_kernels`), :mod:`.triton_decode` the decoding launcher split over the keys
(kernels in :mod:`.triton_decode_kernels`). Imports :mod:`hf_sparsemax.mappings`, the torch path (:mod:`..blocked`,
its references and decoding limits) and nothing above.
"""

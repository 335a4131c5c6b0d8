"""The CPU kernel: the fused C attention (one pass a row: scores, threshold, weighted values; decoding, paged
decoding and the int8 key certificate), :mod:`.fused` its ctypes entry points and argument checks, :mod:`.kernel_build`
its compile on first use (constants from Python in a generated header). The lowest backend: imports
:mod:`hf_sparsemax.mappings` only, never the rest of :mod:`hf_sparsemax.attention`.
"""

"""Quantized checkpoints read as the dense model they stand for, one weight at a time, or refused by name.

- :mod:`.detect`: which scheme a checkpoint's config.json states (``quantization_config``), and the stored tensors
  that give a quantized checkpoint away when its config states none;
- :mod:`.source`: :class:`~.source.QuantizedSource`, the reader that dequantizes each weight when it is read;
- :mod:`.scheme`: what a scheme is to that reader (:class:`~.scheme.Scheme`, :class:`~.scheme.Packed`);
- one module per family of layouts: :mod:`.fp8` (transformers' ``fp8``, ``fbgemm_fp8``), :mod:`.compressed`
  (compressed-tensors), :mod:`.gptq` (GPTQ and AWQ), :mod:`.mxfp4` (gpt-oss's expert stacks), :mod:`.bnb`
  (bitsandbytes 4-bit and 8-bit); :mod:`.packing`: the bit packing they share;
- :mod:`.output`: a merged model written in FP8 (``--quantize``), with each weight's quantization error.
"""

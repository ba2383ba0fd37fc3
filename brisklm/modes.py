"""The quantization modes and group sizes, listed once. No torch import: the
CLI's parser reads them before anything heavy loads."""

RTN_MODES = ("int8", "q8_0", "int4", "fp8")  # what quantize.quantize_state_dict makes
FILE_MODES = (*RTN_MODES, "int4-gptq", "gguf")  # what `brisk quantize --mode` writes
LOAD_MODES = ("auto", "none", *FILE_MODES)  # `--quantize` and load(quantize=...)
GROUP_SIZES = (32, 64, 128, 256)  # inputs per int4 group (and per grouped int8 scale)

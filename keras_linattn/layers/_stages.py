"""Former module of `ShortConvolution` and `OutputNorm`, kept so that imports of this path still work."""

from keras_linattn.layers._output_norm import OUTPUT_NORM_EPSILON, OutputNorm  # noqa: F401
from keras_linattn.layers._short_conv import ShortConvolution  # noqa: F401

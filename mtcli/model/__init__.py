"""The Transformer of "Attention Is All You Need" and its incremental decoding state.

Imports nothing from training or decoding: it is the model and nothing else.
"""

from mtcli.model.incremental import DecoderCache, EncoderOutput, Workspace
from mtcli.model.layers import LAYER_NORM_EPS
from mtcli.model.transformer import Transformer, count_parameters

__all__ = ["LAYER_NORM_EPS", "DecoderCache", "EncoderOutput", "Transformer", "Workspace",
           "count_parameters"]

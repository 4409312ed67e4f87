"""specgen: speculative decoding for language models, shown round by round."""

__version__ = "0.1.0"

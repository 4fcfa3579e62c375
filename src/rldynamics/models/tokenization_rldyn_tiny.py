"""The tokenizer class that a tiny-model checkpoint's ``auto_map`` names; copied next to every saved tiny tokenizer.

transformers 5 rebuilds the tokenizer of a ``qwen2`` checkpoint as ``Qwen2Tokenizer``, whose ``__init__``
replaces the saved pre-tokeniser with Qwen's regex (other ids). A ``tokenizer_config.json`` with an
``auto_map`` entry for ``AutoTokenizer`` skips that rebuild: without ``trust_remote_code`` transformers then
loads the declared generic ``TokenizersBackend``, and with it this class. Both read ``tokenizer.json`` as saved,
because a ``TokenizersBackend`` subclass without its own ``__init__`` loads the file verbatim. This module
imports only transformers, so it runs wherever the checkpoint is loaded.
"""

from transformers import TokenizersBackend


class RldynTinyTokenizer(TokenizersBackend):
    """``TokenizersBackend`` as saved: the normaliser, pre-tokeniser and vocabulary of ``tokenizer.json``."""

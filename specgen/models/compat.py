"""What differs between the transformers versions specgen runs on (pyproject: >=5.0,<6), found
once at import so that no call site checks a version.

`CACHE_ARG`: the keyword a model's forward takes its cache by. transformers 5.24 renamed
`past_key_values` to `cache`; the old name still works there with a FutureWarning and is to be
removed in 5.40, while 5.0-5.23 know only the old one.
"""

from __future__ import annotations

import inspect

from transformers import LlamaForCausalLM

CACHE_ARG = (
    "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
)

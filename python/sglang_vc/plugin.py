"""SGLang general plugin (entry point ``sglang.srt.plugins``).

SGLang runs ``load`` early in every process it starts (launcher, tokenizer manager,
scheduler, detokenizer), so this is where the project registers its backends and
algorithms with SGLang's registries and installs the few hooks of ``sglang_vc.hooks``.
"""

import logging

logger = logging.getLogger(__name__)


def load() -> None:
    from sglang_vc import hooks, registrations

    registrations.register_all()
    hooks.install()

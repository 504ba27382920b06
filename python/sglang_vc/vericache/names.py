"""Names VeriCache registers with SGLang and shows to users (no imports)."""

ALGORITHM = "VERICACHE"
ATTENTION_BACKEND = "vc_verify"  # vc_torch plus TARGET_VERIFY over the full KV
DEFAULT_DRAFT_TOKENS = 4  # X before the data to choose it (and lockstep's X)
# without --speculative-num-draft-tokens, X is chosen from data up to this (SGLang reserves
# 2X slots per request past its committed length)
AUTO_MAX_DRAFT_TOKENS = 32
META_INFO_KEY = "sglang_vc_vericache"
# the remote setting (paper 5.3): draft from a compressed copy of a stored prefix, verify
# each round on a server near the store (--vc-remote-verifier URL)
REMOTE_ALGORITHM = "VERICACHE_REMOTE"
DEFAULT_REMOTE_DRAFT_TOKENS = 8
CHAIN_BACKEND = "vc_chain"  # vc_torch plus chain TARGET_VERIFY forwards (tiering on the CPU)

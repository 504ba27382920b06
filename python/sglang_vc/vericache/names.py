"""Names VeriCache registers with SGLang and shows to users (no imports)."""

ALGORITHM = "VERICACHE"
ATTENTION_BACKEND = "vc_verify"  # vc_torch plus TARGET_VERIFY over the full KV
DEFAULT_DRAFT_TOKENS = 4
META_INFO_KEY = "sglang_vc_vericache"

"""Names SpeCache registers with SGLang and shows to users (no imports)."""

ALGORITHM = "SPECACHE"
ATTENTION_BACKEND = "specache"  # vc_torch plus eq. 1's attention with prefetched rows
META_INFO_KEY = "sglang_vc_specache"
STATS = "specache"  # the /server_info and /metrics counter group

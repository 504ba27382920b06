"""Names the compressed-KV runtime registers with SGLang and shows to users (no imports,
so that flag handling and ``/server_info`` can use them without loading torch code)."""

ATTENTION_BACKEND = "vc_torch"
RADIX_CACHE_BACKEND = "vc"
REQUEST_KEYS = ("vc_compressor", "vc_compression_ratio", "vc_kv_bits")  # in custom_params
META_INFO_KEY = "sglang_vc_compression"
# SGLang's token pools reserve slot 0 for padded writes and never allocate it: a row
# position whose token was dropped points here, and attention skips it.
NULL_SLOT = 0
# Every attention backend the project registers (they wrap SGLang's own; see backend.py).
PROJECT_ATTENTION_BACKENDS = ("vc_torch", "vc_verify", "specache", "vc_speccache")

"""Names SpecCache's server path shares between its modules and with clients."""

GROUP = "speccache"  # flag group, /server_info mechanism, stats counters
ATTENTION_BACKEND = "vc_speccache"  # vc_torch plus the selective-recompute prefill
RADIX_CACHE_BACKEND = "speccache"  # SGLang's unified radix cache plus chunk lookups and locks

# A RAG prompt marks its retrieved chunks with this separator (the LMCache CacheBlend
# way): ``prefix SEP chunk 1 SEP ... SEP chunk c SEP query``. ``--speccache-separator``.
DEFAULT_SEPARATOR = "<|vc_chunk|>"
# epic measured best at the default ratio on the 60-item served runs of #76 (docs/speccache.md:
# "Which selector is the default"); the paper's small-model selector stays as "speccache"
DEFAULT_SELECTOR = "epic"
DEFAULT_RATIO = 0.15
DEFAULT_SPEC_MODEL = "smollm2-135m"

# sampling_params.custom_params keys a request may send
# (speccache_return_selection: true puts the recomputed chunk positions in meta_info,
# for analysis: which tokens a selector chose; speccache_overlap: false runs the selection
# after the chunks' fetch instead of beside it, to measure what the overlap buys)
REQUEST_KEYS = ("speccache_selector", "speccache_ratio", "speccache_return_selection", "speccache_overlap")
# the plan the server's front end attaches for the scheduler; a client's is refused
PLAN_KEY = "_speccache_plan"
META_INFO_KEY = "sglang_vc_speccache"  # meta_info of each SpecCache response
FETCH_RID_PREFIX = "speccache-fetch-"  # request ids of the front end's own chunk fetches

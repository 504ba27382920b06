"""SpecCache: RAG chunk KV reused at any position, with the tokens to recompute chosen
by a small speculative model ("SpecCache: Speculative KV Cache Reuse for Efficient RAG
Serving"). Built so far: the selection math (:mod:`.spans`) and the cross-tokenizer
alignment (:mod:`.align`). Not built yet: the chunk KV store, positional recovery, the
selective-recompute prefill in the server, the selectors' interface and baselines, the
speculative model in the server, the RAG workload and benchmark."""

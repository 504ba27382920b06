"""SpeCache ("SpeCache: Speculative Key-Value Caching for Efficient Generation of LLMs",
Jie et al.): a 1-2 bit KIVI copy of the KV on the
device, the full-precision KV in host memory, and each decode step forwarding the output
token together with a speculative next token whose attention picks the top-k
full-precision rows to prefetch for the next step.

* :mod:`.config`: one configuration (bits, top-k, residual, speculative or not);
* :mod:`.core`: the attention of eq. 1 with the prefetched rows substituted, top-k
  selection and prefetch coverage, pure torch, shared by serving and the lab;
* the fidelity lab's exact HF simulation is :mod:`sglang_vc.bench.specache_hf`.
"""

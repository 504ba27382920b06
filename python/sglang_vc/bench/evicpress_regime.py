"""The hardware regime EvicPress's claim is tested in, emulated on this machine
(``bench.evicpress --regime h100-8b``).

EvicPress trades a context's load time from a tier against recomputing it and against
the quality a compressed copy loses. Which trade wins depends on one ratio per tier: the
time to load a token's KV from it over the time to prefill that token. On this CPU the
device and host tiers are one DRAM and a small model prefills slowly, so loads look free
and placement barely shows. The emulation throttles each tier (``--evicpress-throttle``)
so that the ratio here is the reference hardware's:

    bandwidth here = KV bytes per token here x prefill tokens/s here / (load / prefill there)

The reference, per token (``H100_8B``): Llama-3.1-8B's KV in bfloat16, 2 x 32 layers x 8
KV heads x 128 x 2 B = 128 KiB (the paper's 0.12 GB per 1K tokens); its prefill at 2 x
8.0e9 FLOPs over half of an H100 SXM's 989 dense bfloat16 TFLOP/s, 32 us; host DRAM at
25 GB/s, 5.2 us (0.16 of a prefill); an SSD at 3 GB/s, 44 us (1.35). The prefill figure is
a nominal estimate, not a measurement (attention adds little at 1-4k tokens); the JSON
and the plot's title say so. Capacities follow the issue: the device tier at most a fifth
of the contexts' full KV, the host at most half, storage unbounded.
"""

from __future__ import annotations

import dataclasses

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Regime:
    """Per-token costs on a reference machine, and the tier capacities as shares of the
    workload's full KV (None: unbounded)."""

    name: str
    kv_bytes_per_token: int
    prefill_tokens_per_s: float
    host_bytes_per_s: float
    disk_bytes_per_s: float
    device_share: float
    host_share: float
    source: str

    def load_over_prefill(self, bytes_per_s: float) -> float:
        """A token's load time from a tier of ``bytes_per_s`` over its prefill time."""
        return self.kv_bytes_per_token * self.prefill_tokens_per_s / bytes_per_s


H100_8B = Regime(
    name="h100-8b", kv_bytes_per_token=2 * 32 * 8 * 128 * 2,
    prefill_tokens_per_s=0.5 * 989e12 / (2 * 8.0e9),
    host_bytes_per_s=25 * GB, disk_bytes_per_s=3 * GB, device_share=0.2, host_share=0.5,
    source="nominal: Llama-3.1-8B bfloat16 KV (128 KiB/token); prefill 2 x 8.0e9 FLOPs at 50% of an H100 SXM's "
           "989 TFLOP/s; host DRAM 25 GB/s; SSD 3 GB/s (estimates, not measurements)")

REGIMES = {r.name: r for r in (H100_8B,)}


@dataclasses.dataclass(frozen=True)
class Emulated:
    """The tier bandwidths that give this machine the regime's load / prefill ratios."""

    regime: str
    prefill_tokens_per_s: float  # measured here
    kv_bytes_per_token: int  # here
    host_bytes_per_s: float
    disk_bytes_per_s: float
    host_load_over_prefill: float
    disk_load_over_prefill: float
    source: str

    def server_flags(self) -> list[str]:
        """The EvicPress server flags that apply it (bandwidths in GB/s)."""
        return ["--evicpress-throttle", "--evicpress-host-bandwidth", f"{self.host_bytes_per_s / GB:.6g}",
                "--evicpress-disk-bandwidth", f"{self.disk_bytes_per_s / GB:.6g}",
                "--evicpress-prefill-tokens-per-s", f"{self.prefill_tokens_per_s:.6g}"]


def emulate(regime: Regime, prefill_tokens_per_s: float, kv_bytes_per_token: int) -> Emulated:
    """The bandwidths at which a token's load from each tier costs the regime's multiple of
    its prefill here (``prefill_tokens_per_s`` measured on this machine)."""
    if not prefill_tokens_per_s > 0 or kv_bytes_per_token <= 0:
        raise ValueError("the prefill rate and the KV bytes per token must be positive")
    host, disk = (regime.load_over_prefill(b) for b in (regime.host_bytes_per_s, regime.disk_bytes_per_s))
    per_s = kv_bytes_per_token * prefill_tokens_per_s
    return Emulated(regime.name, prefill_tokens_per_s, kv_bytes_per_token, per_s / host, per_s / disk, host, disk,
                    regime.source)


def capacities(regime: Regime, full_kv_bytes: int) -> dict[str, int]:
    """Tier capacities for a workload whose contexts' full KV totals ``full_kv_bytes``."""
    return {"device": int(regime.device_share * full_kv_bytes), "host": int(regime.host_share * full_kv_bytes)}


def measure_prefill(client, prompts: list[list[int]]) -> float:
    """This machine's prefill rate on the bench's own server: tokens over time to the first
    token of ``prompts``, each in a namespace of its own (nothing cached), the median."""
    rates = sorted(len(ids) / client.stream(ids, 1, extra_key=f"regime-probe-{i}")[0] for i, ids in enumerate(prompts))
    return rates[len(rates) // 2]

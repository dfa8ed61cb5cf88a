"""One line per record of `kvstore bench engine` JSON files: the figures the note quotes."""

from __future__ import annotations

import json
import sys

for path in sys.argv[1:]:
    with open(path) as file:
        results = json.load(file)["results"]
    for r in results:
        print(
            f"{path.rsplit('/', 1)[-1]} L={r['prompt_tokens']} cached={r['cached_fraction']}"
            f" ttft={r['ttft_s'] * 1e3:.1f}ms cold={r['ttft_cold_s'] * 1e3:.1f}"
            f" ref={r['ttft_reference_cold_s'] * 1e3:.1f} speedup={r['speedup']:.2f}"
            f" vs_ref={r['speedup_vs_reference']:.2f} fetch={r['fetch_s'] * 1e3:.1f}"
            f" compute={r['compute_s'] * 1e3:.1f} suffix={r['suffix_compute_s'] * 1e3:.1f}"
            f" suffix_tok_s={r['suffix_tokens_per_s']:.0f} mfu={r['cold_mfu']:.2f}"
            f" fetch_gbps={r.get('fetch_gb_per_s', 0):.2f}/{r['break_even_gb_per_s']:.2f}"
        )

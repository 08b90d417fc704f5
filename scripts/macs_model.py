"""The step model for a target sharded over n Macs, tensor parallel and split by layers: the predicted ar and
mirror speed at each size over a TCP ring and over JACCL's RDMA (docs/bench/across-macs.md). Not a
measurement: every input is a constant below, with its source in docs/bench/across-macs.md.

`python scripts/macs_model.py` prints the markdown table.
"""

C = 50e-3  # one Mac's forward of a dense ~70B model at 4 bits (~40 GB read at ~800 GB/s)
ROWS_COST = 1.1  # a forward of γ+1 = 8 rows against one row's (the weights are read once)
LAYERS, HIDDEN, BYTES = 80, 8192, 2
BETA = 6e9  # bytes/s on one Thunderbolt link
LINKS = {"TCP ring": 300e-6, "JACCL RDMA": 3e-6}  # α: latency per message
TOKENS_PER_FORWARD, REUSE, FALLBACK_WINDOW = 3.0, 0.8, 8e-3  # mirror's speculation (the draft on the ANE)


def hop(alpha: float, rows: int) -> float:
    return alpha + rows * HIDDEN * BYTES / BETA


def tensor_forward(n: int, alpha: float, rows: int) -> tuple[float, float]:
    """(seconds, of which communication): C/n of compute, 2 ring all-reduces per layer."""
    if n == 1:
        return C * (ROWS_COST if rows > 1 else 1.0), 0.0
    payload = rows * HIDDEN * BYTES
    comm = 2 * LAYERS * (2 * (n - 1) * alpha + 2 * (n - 1) / n * payload / BETA)
    return C / n * (ROWS_COST if rows > 1 else 1.0) + comm, comm


def pipeline_forward(n: int, alpha: float, rows: int) -> tuple[float, float]:
    """(seconds, of which communication): the stages run one after another (C in all), n−1 sends between
    them and a ring all_gather of the last stage's output (n−1 hops)."""
    comm = 2 * (n - 1) * hop(alpha, rows) if n > 1 else 0.0
    return C * (ROWS_COST if rows > 1 else 1.0) + comm, comm


def main() -> None:
    print("| split | Macs | link | ar forward (of it, comm) | ar tok/s | mirror step | mirror tok/s | mirror / ar |")
    print("|---|---|---|---|---|---|---|---|")
    for name, forward in (("tensor", tensor_forward), ("layers", pipeline_forward)):
        for link, alpha in LINKS.items():
            for n in (1, 2, 4, 8):
                if n == 1 and (name, link) != ("tensor", "TCP ring"):
                    continue
                ar, comm = forward(n, alpha, 1)
                step = forward(n, alpha, 8)[0] + (1 - REUSE) * FALLBACK_WINDOW
                mirror = TOKENS_PER_FORWARD / step
                print(f"| {name if n > 1 else 'one Mac'} | {n} | {link if n > 1 else 'none'} | {1e3 * ar:.1f} ms "
                      f"({1e3 * comm:.1f}) | {1 / ar:.1f} | {1e3 * step:.1f} ms | {mirror:.1f} | {mirror * ar:.2f}x |")


if __name__ == "__main__":
    main()

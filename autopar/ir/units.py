"""Bytes and seconds as a person reads them, in tables and messages alike."""


def fmt_bytes(x: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B"


def fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} us"

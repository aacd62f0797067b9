"""The columns of the tables that the demo and ``rlhflab compare`` print and the report
draws: one definition for the code that writes them and the code that reads them back."""

import math

# evaluate_policy's keys, per policy (the demo's verdict table)
DEMO_COLUMNS = (
    "gold",
    "proxy",
    "accuracy",
    "kl_to_reference",
    "length",
    "flattery_rate",
    "repetition_rate",
)

# one row per method of `rlhflab compare`
COMPARE_COLUMNS = ("gold", "proxy", "accuracy", "kl_to_reference", "wall_s", "peak_mib", "models")

# columns measured in units, not reward points: shown as whole numbers with the unit
UNITS = {"wall_s": "s", "peak_mib": "MiB"}


def cell(column: str, value) -> str:
    """One table cell as the demo, compare and the report print it: rewards and KL to 3
    decimals, time and memory as integers with their unit ("612 MiB", not 612.000)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "-"
    if column in UNITS and isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{round(value):,} {UNITS[column]}"
    if isinstance(value, float):
        text = f"{value:.3f}"
        return "0.000" if text == "-0.000" else text  # a k1 KL of -2e-4 rounds to zero
    return "-" if value is None else str(value)

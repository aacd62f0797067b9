"""The maths: pure functions of tensors (torch only), each checked against a plain float64 loop."""

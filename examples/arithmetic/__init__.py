"""Single-turn multi-operand addition with worked running sums; the quickstart task."""

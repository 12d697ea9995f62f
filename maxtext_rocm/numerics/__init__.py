"""Numbers: precision policies, the fp8 dot, the cross entropy."""

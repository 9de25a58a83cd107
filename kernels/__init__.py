"""Compute kernels. Each Triton kernel sits beside a plain-torch reference with the same
signature; `kernels.ops` picks the implementation for the device."""

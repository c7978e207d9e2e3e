"""Block Attention Residuals in K3's layout."""
from .naive import naive_block_attnres

__all__ = ["naive_block_attnres"]

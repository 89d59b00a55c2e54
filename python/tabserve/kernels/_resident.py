"""The one shape ``tabserve::feed_forward_resident`` serves, for the Python side of the package.

The C++ kernel's ``kResidentDim`` / ``kResidentHidden`` (csrc/ops/feed_forward.h) are the same
numbers: at width 128 and FFN width 256 both weight matrices fit shared memory in half precision.
This module imports nothing, so ``tabserve.ops`` (the operator's fake kernel) and
``tabserve.kernels.feed_forward`` (the dispatcher that routes those shapes to it) both read it
without importing each other.
"""

#: Token width (the column and row stages' embedding width).
RESIDENT_DIM = 128
#: FFN width (twice the token width).
RESIDENT_HIDDEN = 256

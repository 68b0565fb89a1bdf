"""The quantization schemes qserve knows and the backends that write them."""

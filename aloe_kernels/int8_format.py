"""Constants of the int8 address format (:mod:`aloe_kernels.int8_addresses`), shared with the kernels."""

#: Columns per float16 scale (the streaming kernel's screen steps over one group at a time).
GROUP = 128
#: Largest int8 level used (symmetric: -127..127).
LEVELS = 127

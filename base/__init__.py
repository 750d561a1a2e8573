"""What every layer uses: errors, units, process settings, the integer-program helper.

The bottom layer: it imports nothing of Harmony's, and every other layer (compiler/, passes/, runtime/,
viz/ and the face, harmony/) may import it.
"""

"""The gate: every inference body parsed once into its route's typed request, checked, before admission counts it."""

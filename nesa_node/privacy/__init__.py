"""Privacy modes: client-held edge blocks, boundary noise, and the leakage meter that measures what each hides."""

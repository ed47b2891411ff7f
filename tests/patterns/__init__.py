"""The pattern zoo: small models built the way real ones are, each proven equal to plain PyTorch under zoff."""

"""The ways DCMHA is computed."""

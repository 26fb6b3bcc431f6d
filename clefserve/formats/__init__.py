"""Model release formats: one subpackage per format (encoder, head, answers)."""

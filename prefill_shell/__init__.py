"""Imperative shell of the prefill runtime: every device touch lives here."""

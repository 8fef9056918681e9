"""reference package."""

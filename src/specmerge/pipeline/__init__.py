"""Recipe, plan, executor and the public merge API."""

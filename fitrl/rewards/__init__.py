"""Rule rewards: plain functions over text returning the total and its components."""

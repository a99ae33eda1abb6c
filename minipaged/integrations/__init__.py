"""minipaged inside the serving frameworks people already run.

- `ray_serve` - replicas of the OpenAI-compatible server placed, restarted and
  autoscaled by Ray Serve: ``minipaged serve-ray MODEL --num-replicas N``.  Needs the
  ``ray`` extra (``pip install minipaged[ray]``).
"""

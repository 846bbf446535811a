"""POD adaptation: recipe, data, exploration, DeepSpeed training, export and Hub push.

Entry point: ``deepspeed train/pod.py RECIPE.yaml [section.field=value ...]`` (or plain ``python``).
"""

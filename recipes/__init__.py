"""Recipes: one folder per way of growing a scenario (sao/, ...), each with its README.

Importing a recipe package never imports torch; the torch parts (losses, critics) are
separate modules that only trainer processes load.
"""

"""``asyncrl.rl.driver.scaling.scale``, the name docs/elastic.md gives users; the fleet's scaling
lives in driver/fleet/scaling.py."""

from asyncrl.rl.driver.fleet.scaling import scale

__all__ = ["scale"]

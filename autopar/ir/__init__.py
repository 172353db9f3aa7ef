"""The data model every layer shares: meshes, device profiles, placements, the plan graph, plans,
precision and parameter state, errors. Imports nothing else of autopar."""

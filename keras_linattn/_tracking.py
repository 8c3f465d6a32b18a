"""Makes `tf.train.Checkpoint` see every variable that Keras tracks.

On the TensorFlow backend a Keras 3 layer is a TF `AutoTrackable`, but its
checkpoint graph only follows plain attributes. State that Keras tracks by
other means is invisible to `tf.train.Checkpoint` and `CheckpointManager`,
which then save and restore part of a model and report success:

- layers or variables held in a list or dict (Keras wraps it in a
  ``TrackedList``/``TrackedDict``, which TF does not follow), e.g. the
  blocks of `LinearCausalLM` or the branch weights of a trainable map;
- `keras.random.SeedGenerator` states (dropout masks): a seed generator is
  not a TF trackable, so its ``state`` variable is never reached, neither
  in our layers nor in the Keras layers they hold (`keras.layers.Dropout`);
- weights created with ``add_weight`` but not kept in an attribute.

`CheckpointTracked` adds them as extra children of the object's checkpoint
graph (``save_type="checkpoint"`` only: SavedModel export and the Keras
formats are untouched, so ``.keras`` weight paths do not change). Names are
deterministic: ``<attribute>_<index or key>`` for a Keras-tracked list or
dict attribute, then ``keras_variable_<i>``, ``keras_seed_generator_<i>``,
``keras_layer_<i>`` and ``keras_layer_<i>_seed_generator_<j>`` (positions
in the layer's own Keras lists) for anything still unreached.
"""

import keras

from keras_linattn import _compat

__all__ = ["CheckpointTracked"]


def _add(children, present, name, value):
    """Adds `value` under `name` unless it is already a child."""
    if id(value) in present:
        return
    while name in children:
        name = name + "_"
    children[name] = value
    present.add(id(value))


def _walk(children, present, name, value):
    """Adds the layers, variables and seed states nested in a list/tuple/dict `value`."""
    if isinstance(value, keras.layers.Layer) or isinstance(value, keras.Variable):
        _add(children, present, name, value)
    elif isinstance(value, keras.random.SeedGenerator):
        _add(children, present, name, value.state)
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            _walk(children, present, f"{name}_{key}", value[key])
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _walk(children, present, f"{name}_{index}", item)


def _keras_layers(layer):
    """`layer` and its sublayers, depth first, not entering (nor listing) a `CheckpointTracked` layer."""
    if isinstance(layer, CheckpointTracked):
        return []
    found = [layer]
    for sublayer in _compat.sublayers(layer):
        found += _keras_layers(sublayer)
    return found


class CheckpointTracked:
    """Mixin (before the Keras base class): every variable reaches `tf.train.Checkpoint`.

    See the module docstring. On other backends it does nothing.
    """

    # TF's checkpoint hook (`_compat.check_trackable_children_hook`, checked below).
    def _trackable_children(self, save_type="checkpoint", **kwargs):
        children = _compat.trackable_children(super(), save_type, **kwargs)
        if save_type != "checkpoint":
            return children
        present = {id(value) for value in children.values()}
        for attribute in _compat.tracked_collection_attributes(self):
            value = getattr(self, attribute, None)
            if isinstance(value, (list, tuple, dict)):
                _walk(children, present, attribute.lstrip("_"), value)
        own = _compat.own_variables(self)
        for index, variable in enumerate(own):
            _add(children, present, f"keras_variable_{index}", variable)
        for index, generator in enumerate(_compat.seed_generators(self)):
            _add(children, present, f"keras_seed_generator_{index}", generator.state)
        for index, layer in enumerate(_compat.sublayers(self)):
            _add(children, present, f"keras_layer_{index}", layer)
            # A Keras layer (e.g. `Dropout`) keeps its seed generator in an
            # attribute TF does not follow: its state is added here, for it
            # and its own Keras sublayers (ours add theirs themselves).
            generators = [
                generator for sublayer in _keras_layers(layer) for generator in _compat.seed_generators(sublayer)
            ]
            for number, generator in enumerate(generators):
                _add(children, present, f"keras_layer_{index}_seed_generator_{number}", generator.state)
        return children


_compat.check_trackable_children_hook()

"""The output shape of a layer that maps its input element by element (or channel by channel)."""


class ShapePreserving:
    """Mixin, before `keras.layers.Layer` in the bases: the output has the input's shape.

    An explicit `compute_output_shape` spares Keras the symbolic call it would otherwise trace
    to infer the shape.
    """

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        """The output shape: `input_shape` itself.

        Args:
            input_shape: the input's shape.

        Returns:
            `input_shape`.
        """
        return input_shape

//! Builder-style setters for option structs.

/// Writes, inside an `impl` block, one `pub fn field(self, field: Type) -> Self` per listed
/// field, returning `self` with that field replaced (each with the doc comment given before it).
///
/// Every option struct of the workspace (`Config`s, hyperparameters, GEMM options) is built as
/// `Config::default().field(value)…`; the setters are this one macro rather than a hand-written
/// copy per field.
///
/// ```
/// #[derive(Debug, Default, PartialEq)]
/// pub struct Options {
///     depth: usize,
///     scale: f64,
/// }
///
/// impl Options {
///     flatpeak_common::setters! {
///         /// These options with this depth.
///         depth: usize,
///         /// These options with this scale.
///         scale: f64,
///     }
/// }
///
/// assert_eq!(Options::default().depth(3).scale(0.5), Options { depth: 3, scale: 0.5 });
/// ```
#[macro_export]
macro_rules! setters {
    ($($(#[$doc:meta])* $field:ident: $ty:ty),* $(,)?) => {
        $(
            $(#[$doc])*
            #[must_use]
            pub fn $field(self, $field: $ty) -> Self {
                Self { $field, ..self }
            }
        )*
    };
}

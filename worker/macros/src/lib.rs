//! `#[tool]`: turns a plain `async fn(args: A, ctx: &ToolContext) -> Result<O, E>` into a
//! fleet tool. The function stays as written (callable from unit tests); next to it the
//! attribute adds `fn <name>_tool() -> toolfleet_worker::Tool`, built with
//! `Tool::builder(..).typed(..)`: input and output schemas derived from `A` and `O`, the
//! summary from `O`'s `Display`, `E: Into<ToolError>`.
//!
//! Attributes: `name = "crm.lookup"` (default: the function's name), `description = ".."`
//! (default: the doc comment), `idempotent = 3`, `timeout_ms = 2000`,
//! `waiting_hint = ".."`, `tenant_scoped`, `allow_unknown_arguments`. This crate only
//! generates code; everything it calls lives in `toolfleet-worker`, which re-exports it.

use proc_macro::TokenStream;
use proc_macro2::TokenStream as Tokens;
use quote::{format_ident, quote};
use syn::spanned::Spanned;
use syn::{parse_macro_input, FnArg, ItemFn, LitInt, LitStr};

/// Makes an async fn a fleet tool; see the crate documentation.
#[proc_macro_attribute]
pub fn tool(attr: TokenStream, item: TokenStream) -> TokenStream {
    let function = parse_macro_input!(item as ItemFn);
    let mut settings = Settings::default();
    let parser = syn::meta::parser(|meta| settings.read(meta));
    parse_macro_input!(attr with parser);
    match expand(&settings, &function) {
        Ok(tokens) => tokens.into(),
        Err(error) => error.to_compile_error().into(),
    }
}

/// What the attribute's arguments say.
#[derive(Default)]
struct Settings {
    name: Option<LitStr>,
    description: Option<LitStr>,
    modifiers: Vec<Tokens>,
}

impl Settings {
    /// Reads one `key = value` or flag of the attribute.
    fn read(&mut self, meta: syn::meta::ParseNestedMeta) -> syn::Result<()> {
        let key = meta
            .path
            .get_ident()
            .map(ToString::to_string)
            .unwrap_or_default();
        match key.as_str() {
            "name" => self.name = Some(meta.value()?.parse()?),
            "description" => self.description = Some(meta.value()?.parse()?),
            "waiting_hint" => {
                let hint: LitStr = meta.value()?.parse()?;
                self.modifiers.push(quote!(.waiting_hint(#hint)));
            }
            "idempotent" => {
                let attempts: LitInt = meta.value()?.parse()?;
                self.modifiers.push(quote!(.idempotent(#attempts)));
            }
            "timeout_ms" => {
                let ms: LitInt = meta.value()?.parse()?;
                self.modifiers
                    .push(quote!(.timeout(::std::time::Duration::from_millis(#ms))));
            }
            "tenant_scoped" => self.modifiers.push(quote!(.tenant_scoped())),
            "allow_unknown_arguments" => self.modifiers.push(quote!(.allow_unknown_arguments())),
            _ => return Err(meta.error(format!("unknown tool attribute `{key}`"))),
        }
        Ok(())
    }
}

/// The function as written, and its `<name>_tool()` constructor.
fn expand(settings: &Settings, function: &ItemFn) -> syn::Result<Tokens> {
    let sig = &function.sig;
    if sig.asyncness.is_none() {
        return Err(syn::Error::new(
            sig.span(),
            "a #[tool] function must be async",
        ));
    }
    let inputs: Vec<&FnArg> = sig.inputs.iter().collect();
    let args_type = match inputs.first() {
        Some(FnArg::Typed(arg)) => &arg.ty,
        _ => {
            return Err(syn::Error::new(
                sig.span(),
                "a #[tool] function takes its arguments first: `async fn f(args: Args, ctx: &ToolContext)`",
            ))
        }
    };
    let call = match inputs.len() {
        1 => quote!(args),
        2 => quote!(args, &ctx),
        _ => {
            return Err(syn::Error::new(
                sig.inputs.span(),
                "a #[tool] function takes `args` and optionally `ctx: &ToolContext`",
            ))
        }
    };
    let ident = &sig.ident;
    let name = settings
        .name
        .clone()
        .unwrap_or_else(|| LitStr::new(&ident.to_string(), ident.span()));
    let description = match &settings.description {
        Some(d) => d.clone(),
        None => doc_comment(function)
            .map(|d| LitStr::new(&d, ident.span()))
            .ok_or_else(|| {
                syn::Error::new(
                    sig.span(),
                    "a #[tool] needs a doc comment or `description = \"..\"`",
                )
            })?,
    };
    let constructor = format_ident!("{}_tool", ident);
    let vis = &function.vis;
    let modifiers = &settings.modifiers;
    Ok(quote! {
        #function

        #[doc = concat!("The fleet tool `", #name, "`, served by [`", stringify!(#ident), "`].")]
        #vis fn #constructor() -> ::toolfleet_worker::Tool {
            ::toolfleet_worker::Tool::builder(#name, #description)
                #(#modifiers)*
                .typed(|ctx: ::toolfleet_worker::ToolContext, args: #args_type| async move {
                    let _ = &ctx;
                    #ident(#call).await
                })
        }
    })
}

/// The function's doc comment as one line of text; `None` when it has none.
fn doc_comment(function: &ItemFn) -> Option<String> {
    let lines: Vec<String> = function
        .attrs
        .iter()
        .filter(|a| a.path().is_ident("doc"))
        .filter_map(|a| match &a.meta {
            syn::Meta::NameValue(nv) => match &nv.value {
                syn::Expr::Lit(syn::ExprLit {
                    lit: syn::Lit::Str(s),
                    ..
                }) => Some(s.value().trim().to_string()),
                _ => None,
            },
            _ => None,
        })
        .filter(|l| !l.is_empty())
        .collect();
    (!lines.is_empty()).then(|| lines.join(" "))
}

//! The SDK's macros: `#[tool]`, `#[main]` and `#[derive(ToolError)]`.
//!
//! `#[tool]`: turns a plain `async fn(args: A, ctx: &ToolContext) -> Result<O, E>` into a
//! fleet tool. The function stays as written (callable from unit tests); next to it the
//! attribute adds `fn <name>_tool() -> toolfleet_worker::Tool`, built with
//! `Tool::builder(..).typed(..)`: input and output schemas derived from `A` and `O`, the
//! summary from `O`'s `Display`, `E: Into<ToolError>`. A tool without arguments is
//! `async fn f()` or `async fn f(ctx: &ToolContext)`: its input schema is the empty
//! object.
//!
//! Attributes: `name = "crm.lookup"` (default: the function's name), `description = ".."`
//! (default: the doc comment), `idempotent = 3`, `timeout_ms = 2000`,
//! `waiting_hint = ".."`, `spoken_name = ".."`, `tenant_scoped`, `allow_unknown_arguments`.
//!
//! `#[main(tools = [add, greet])]` on an `async fn main()`: a Tokio runtime runs the body
//! (set-up, if any) and then `toolfleet_worker::serve` with each listed `#[tool]` fn's
//! `<name>_tool()` (`tools = <expr>` serves a `Vec<Tool>` expression instead).
//!
//! `#[derive(ToolError)]` on an enum: `From<E> for ToolError`, one stable code per
//! variant (`#[tool_error(code = "..", retryable, user_message = "..", message = "..")]`;
//! code default: the variant's name in snake case; message default: the `Display` of the
//! error when the enum says `#[tool_error(display)]`, else the variant's doc comment).
//!
//! This crate only generates code; everything it calls lives in `toolfleet-worker`,
//! which re-exports it.

use proc_macro::TokenStream;
use proc_macro2::TokenStream as Tokens;
use quote::{format_ident, quote};
use syn::spanned::Spanned;
use syn::{parse_macro_input, DeriveInput, Expr, FnArg, ItemFn, LitInt, LitStr};

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

/// The name of the setting `meta` reads (`name` in `name = "..."`); empty when the
/// setting is not a plain name, which no setting matches.
fn setting_key(meta: &syn::meta::ParseNestedMeta) -> String {
    meta.path
        .get_ident()
        .map(ToString::to_string)
        .unwrap_or_default()
}

impl Settings {
    /// Reads one `key = value` or flag of the attribute.
    fn read(&mut self, meta: syn::meta::ParseNestedMeta) -> syn::Result<()> {
        let key = setting_key(&meta);
        match key.as_str() {
            "name" => self.name = Some(meta.value()?.parse()?),
            "description" => self.description = Some(meta.value()?.parse()?),
            "waiting_hint" => {
                let hint: LitStr = meta.value()?.parse()?;
                self.modifiers.push(quote!(.waiting_hint(#hint)));
            }
            "spoken_name" => {
                let spoken: LitStr = meta.value()?.parse()?;
                self.modifiers.push(quote!(.spoken_name(#spoken)));
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
    let typed = |arg: &FnArg| match arg {
        FnArg::Typed(arg) => Some(arg.ty.clone()),
        FnArg::Receiver(_) => None,
    };
    let is_context = |ty: &syn::Type| matches!(ty, syn::Type::Reference(_));
    let unit: syn::Type = syn::parse_quote!(());
    // `async fn f()` and `async fn f(ctx: &ToolContext)` take no arguments: their input
    // schema is the empty object.
    let (args_type, call) = match inputs.as_slice() {
        [] => (unit, quote!()),
        [only] => match typed(only) {
            Some(ty) if is_context(&ty) => (unit, quote!(&ctx)),
            Some(ty) => (*ty, quote!(args)),
            None => return Err(receiver_error(sig)),
        },
        [first, second] => match (typed(first), typed(second)) {
            (Some(ty), Some(_)) if !is_context(&ty) => (*ty, quote!(args, &ctx)),
            _ => {
                return Err(syn::Error::new(
                    sig.inputs.span(),
                    "a #[tool] function takes its arguments first: `async fn f(args: Args, ctx: &ToolContext)`",
                ))
            }
        },
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
                    let _ = (&ctx, &args);
                    #ident(#call).await
                })
        }
    })
}

fn receiver_error(sig: &syn::Signature) -> syn::Error {
    syn::Error::new(
        sig.span(),
        "a #[tool] is a free function: `async fn f(args: Args, ctx: &ToolContext)`",
    )
}

/// The function's doc comment as one line of text; `None` when it has none.
fn doc_comment(function: &ItemFn) -> Option<String> {
    doc_lines(&function.attrs)
}

/// A doc comment (`#[doc = ".."]` attributes) as one line of text; `None` when empty.
fn doc_lines(attrs: &[syn::Attribute]) -> Option<String> {
    let lines: Vec<String> = attrs
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

/// Serves the listed tools from `main`; see the crate documentation.
#[proc_macro_attribute]
pub fn main(attr: TokenStream, item: TokenStream) -> TokenStream {
    let function = parse_macro_input!(item as ItemFn);
    let mut tools: Option<Expr> = None;
    let parser = syn::meta::parser(|meta| {
        if meta.path.is_ident("tools") {
            tools = Some(meta.value()?.parse()?);
            Ok(())
        } else {
            Err(meta.error("expected `tools = [..]` or `tools = <expr>`"))
        }
    });
    parse_macro_input!(attr with parser);
    match expand_main(tools, &function) {
        Ok(tokens) => tokens.into(),
        Err(error) => error.to_compile_error().into(),
    }
}

/// `fn main` running the body, then `serve` on the tools.
fn expand_main(tools: Option<Expr>, function: &ItemFn) -> syn::Result<Tokens> {
    let sig = &function.sig;
    if sig.asyncness.is_none() || !sig.inputs.is_empty() {
        return Err(syn::Error::new(
            sig.span(),
            "#[toolfleet_worker::main] goes on `async fn main()`",
        ));
    }
    let tools = match tools {
        Some(Expr::Array(list)) => {
            let constructors = list
                .elems
                .iter()
                .map(tool_constructor)
                .collect::<syn::Result<Vec<_>>>()?;
            quote!(::std::vec![#(#constructors),*])
        }
        Some(expr) => quote!(#expr),
        None => {
            return Err(syn::Error::new(
                sig.span(),
                "name the tools: #[toolfleet_worker::main(tools = [my_tool, other_tool])]",
            ))
        }
    };
    let body = &function.block;
    let attrs = &function.attrs;
    Ok(quote! {
        #(#attrs)*
        fn main() -> ::std::result::Result<(), ::toolfleet_worker::ServeError> {
            ::toolfleet_worker::__private::tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?
                .block_on(async {
                    #body
                    ::toolfleet_worker::serve(#tools).await
                })
        }
    })
}

/// `path::to::f` → `path::to::f_tool()`, the constructor `#[tool]` adds beside `f`.
fn tool_constructor(entry: &Expr) -> syn::Result<Tokens> {
    let Expr::Path(path) = entry else {
        return Err(syn::Error::new(
            entry.span(),
            "list the #[tool] functions by name",
        ));
    };
    let mut path = path.path.clone();
    let last = path
        .segments
        .last_mut()
        .ok_or_else(|| syn::Error::new(entry.span(), "empty path"))?;
    last.ident = format_ident!("{}_tool", last.ident);
    Ok(quote!(#path()))
}

/// `From<E> for ToolError` for an error enum; see the crate documentation.
#[proc_macro_derive(ToolError, attributes(tool_error))]
pub fn derive_tool_error(item: TokenStream) -> TokenStream {
    let input = parse_macro_input!(item as DeriveInput);
    match expand_tool_error(&input) {
        Ok(tokens) => tokens.into(),
        Err(error) => error.to_compile_error().into(),
    }
}

/// What a variant's `#[tool_error(..)]` says.
#[derive(Default)]
struct VariantError {
    code: Option<LitStr>,
    message: Option<LitStr>,
    user_message: Option<LitStr>,
    retryable: bool,
}

impl VariantError {
    fn read(attrs: &[syn::Attribute]) -> syn::Result<Self> {
        let mut out = Self::default();
        for attr in attrs.iter().filter(|a| a.path().is_ident("tool_error")) {
            attr.parse_nested_meta(|meta| {
                let key = setting_key(&meta);
                match key.as_str() {
                    "code" => out.code = Some(meta.value()?.parse()?),
                    "message" => out.message = Some(meta.value()?.parse()?),
                    "user_message" => out.user_message = Some(meta.value()?.parse()?),
                    "retryable" => out.retryable = true,
                    _ => return Err(meta.error(format!("unknown tool_error setting `{key}`"))),
                }
                Ok(())
            })?;
        }
        Ok(out)
    }
}

/// Whether the enum says `#[tool_error(display)]`.
fn uses_display(attrs: &[syn::Attribute]) -> syn::Result<bool> {
    let mut display = false;
    for attr in attrs.iter().filter(|a| a.path().is_ident("tool_error")) {
        attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("display") {
                display = true;
                Ok(())
            } else {
                Err(meta.error("on the enum, only `#[tool_error(display)]`"))
            }
        })?;
    }
    Ok(display)
}

fn expand_tool_error(input: &DeriveInput) -> syn::Result<Tokens> {
    let syn::Data::Enum(data) = &input.data else {
        return Err(syn::Error::new(
            input.span(),
            "#[derive(ToolError)] goes on an enum",
        ));
    };
    let display = uses_display(&input.attrs)?;
    let ident = &input.ident;
    let (impl_generics, type_generics, where_clause) = input.generics.split_for_impl();
    let mut arms = Vec::new();
    for variant in &data.variants {
        let settings = VariantError::read(&variant.attrs)?;
        let name = &variant.ident;
        let code = settings
            .code
            .unwrap_or_else(|| LitStr::new(&snake_case(&name.to_string()), name.span()));
        let fallback = settings
            .message
            .or_else(|| doc_lines(&variant.attrs).map(|d| LitStr::new(&d, name.span())))
            .unwrap_or_else(|| code.clone());
        let message = if display {
            quote!(::std::string::ToString::to_string(&error))
        } else {
            quote!(::std::string::String::from(#fallback))
        };
        let constructor = if settings.retryable {
            quote!(retryable)
        } else {
            quote!(fatal)
        };
        let user = settings
            .user_message
            .map(|u| quote!(.with_user_message(#u)));
        arms.push(quote! {
            #ident::#name { .. } => ::toolfleet_worker::ToolError::#constructor(#code, #message) #user,
        });
    }
    Ok(quote! {
        impl #impl_generics ::std::convert::From<#ident #type_generics> for ::toolfleet_worker::ToolError #where_clause {
            fn from(error: #ident #type_generics) -> Self {
                match &error {
                    #(#arms)*
                }
            }
        }
    })
}

/// `TooCold` → `too_cold`.
fn snake_case(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.extend(c.to_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

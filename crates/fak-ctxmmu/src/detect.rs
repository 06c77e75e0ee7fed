//! Detectors: each inspects a tool result (raw and normalized) and reports at most one
//! finding. They sit behind the [`Detector`] trait so better ones can plug in.

use crate::normalize::{normalize, Normalized};
use base64::Engine as _;
use regex::Regex;
use serde::Serialize;

/// Why a result was quarantined: a closed vocabulary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Reason {
    /// Instructions aimed at the model (prompt injection).
    TrustViolation,
    /// Text imitating the chat template's control tokens or role headers.
    ControlTokenForgery,
    /// A credential (API key, private key, token, password) that must not enter context.
    SecretLeak,
    /// Larger than the screen accepts at all.
    Oversized,
    /// An operator revoked this content (by digest or tool call id).
    Revoked,
}

impl Reason {
    /// The reason's wire name (`TRUST_VIOLATION`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::TrustViolation => "TRUST_VIOLATION",
            Reason::ControlTokenForgery => "CONTROL_TOKEN_FORGERY",
            Reason::SecretLeak => "SECRET_LEAK",
            Reason::Oversized => "OVERSIZED",
            Reason::Revoked => "REVOKED",
        }
    }
}

/// What a detector found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// The detector's name.
    pub detector: &'static str,
    /// The reason it gives.
    pub reason: Reason,
    /// A short excerpt of what matched (at most 80 characters; secrets are masked).
    pub detail: String,
}

/// A screening rule.
pub trait Detector: Send + Sync {
    /// A short stable name, recorded in the audit log.
    fn name(&self) -> &'static str;
    /// Inspects `raw` (the result as received) and `norm` (its normalized forms).
    fn inspect(&self, raw: &str, norm: &Normalized) -> Option<Finding>;
}

fn excerpt(s: &str) -> String {
    let mut e: String = s.chars().take(80).collect();
    if s.chars().count() > 80 {
        e.push('…');
    }
    e
}

/// Prompt-injection phrasing: instructions aimed at the model.
///
/// Matched on every form of the text ([`normalize`]: the normalized text, the text
/// hidden in tag characters or variation selectors, the squashed text), on the text
/// reversed and ROT13-rotated, and on every segment that decodes (base64, base32, hex,
/// percent-encoding, HTML character references, `\u`/`\x` escapes) up to
/// 3 layers deep (`MAX_DECODE_DEPTH`) (base64 in base64, percent-encoding twice, ...).
///
/// The English rules key on structure rather than fixed strings: an imperative that
/// sets something aside (ignore, disregard, forget, set aside, pay no attention to,
/// stop following, ...) followed, within one sentence, by a reference to what the model
/// was told before (its instructions, rules, system prompt, "what you were told
/// earlier", "everything above"); text addressing the reading AI by name and ordering
/// it; claims that its instructions changed; orders to hide something from the user or
/// to send data somewhere. The same families ("ignore the previous instructions",
/// "do not tell the user", "reveal the system prompt", "new instructions:") are written
/// for es, fr, de, it, pt, nl, pl, tr, ru, zh, ja, ko, ar and hi. Role-assignment prose
/// ("you are now a member of the Platform team") is not an injection: "you are now"
/// counts only with an AI persona or an unrestricted mode.
///
/// Sources for the families: the BIPIA and AgentDojo attack templates, Greshake et al.
/// 2023 ("Not what you've signed up for"), Liu et al. 2024 (formalizing prompt
/// injection), the multilingual jailbreak studies (Deng et al. 2024; Yong et al. 2023).
pub struct InjectionDetector {
    patterns: Vec<Regex>,
    squashed: Vec<&'static str>,
}

const GAP: &str = r"[^.!?\n]{0,40}?";

/// Most decoding layers followed (base64 of base64 of ...).
pub const MAX_DECODE_DEPTH: usize = 3;

/// One "verb … object" family in a language: `verbs` then, within a sentence, a
/// reference to earlier orders (`priors` and `objects` in either order), or the same
/// with the verb last (`prior object … verb`, German and Japanese order).
fn family(verbs: &str, priors: &str, objects: &str) -> String {
    let g = r"[^.!?\n。！？]{0,40}?";
    format!(
        r"(?:\b(?:{verbs})\b{g}(?:\b(?:{priors})\b{g}\b(?:{objects})\b|\b(?:{objects})\b{g}\b(?:{priors})\b))|(?:\b(?:{priors})\b{g}\b(?:{objects})\b{g}\b(?:{verbs})\b)"
    )
}

/// Imperative verbs an injection orders the model with (the action half of the
/// "addressed to the AI, then an order" rules).
const IMPERATIVE: &str = "send|forward|e-?mail|delete|remove|erase|wipe|ignore|disregard|forget|reply|respond|tell|say|state|report|claim|inform|call|run|execute|transfer|wire|pay|post|share|upload|download|visit|open|navigate|fetch|click|reveal|print|output|write|include|append|insert|add|grant|approve|invite|create|change|update|set|mark|rank|assign|recommend|present|treat|describe|give|provide|list|summari[sz]e|drop|disable|enable|stop|push|merge|install|buy|purchase|sign|log in|leak|exfiltrate|copy";

/// The English rules (see [`InjectionDetector`]).
fn english() -> Vec<String> {
    let g = GAP;
    // Imperatives that set something aside.
    let aside = r"ignore|ignoring|disregard|disregarding|forget|forgetting|set aside|put aside|lay aside|leave aside|cast aside|push aside|abandon|discard|dismiss|throw out|throw away|stop following|no longer follow|do not follow|don'?t follow|stop obeying|disobey|pay no attention to|pay no heed to|take no notice of|unlearn|overlook|neglect";
    // What the model was told before.
    let prior = r"(?:the|your|all|any|those|these|its|my|each|every|of the|of your)?\s*(?:previous|prior|earlier|preceding|above|foregoing|initial|original|old|former|existing|current|standing|system|developer|operator|given|first|whatever)\s+(?:instructions?|directions?|prompts?|rules|guidelines|guidance|orders|directives|commands|tasks?|programming|configuration|constraints|restrictions|context|briefing|setup|messages?|policies)";
    let yours = r"(?:your|the assistant'?s|the model'?s|the ai'?s)\s+(?:instructions|guidelines|rules|directives|programming|orders|guardrails|restrictions|safety rules|system prompt|prompt|task|mission|objective)";
    let told = r"(?:what|everything|anything|all|whatever)\s+(?:you(?:'ve| have| were| had)?\s+(?:been\s+)?(?:told|given|instructed|asked|programmed|taught|said)|(?:was|were|has been|had been)\s+(?:said|written|stated|told)\s+(?:before|above|earlier|previously)|(?:above|before this|earlier|prior|that came before|said before|up to (?:here|now|this point)))";
    let sysprompt = r"(?:the|your|this)\s+(?:system|hidden|initial|original|developer|base)\s+(?:prompt|message|instructions)";
    vec![
        format!(r"\b(?:{aside})\b{g}\b(?:{prior}|{yours}|{told}|{sysprompt})\b"),
        format!(r"\b(ignore|disregard|forget|override|bypass|skip){g}\b(previous|prior|above|earlier|preceding|initial|original|all|any|your|system|developer)\b{g}\b(instructions?|directions?|prompts?|rules|guidelines|guidance|context|constraints|policies|orders)\b"),
        r"\b(new|updated|revised|real|actual|additional|override|emergency|urgent|hidden|secret|important)\s+(system\s+|admin\s+|developer\s+)?(instructions?|directives?|orders|task)\s*[:\-]".to_string(),
        // "You are now" with an AI persona or an unrestricted mode, not any role.
        r"\byou are now\b[^.!?\n]{0,40}\b(ai|a\.i\.|assistant|language model|llm|chatbot|bot|dan|jailbroken|unrestricted|unfiltered|uncensored|unlocked|free from|free of|freed from|no longer (bound|restricted|limited|an? (ai|assistant))|not bound|without (any )?(restrictions|rules|limits|filters|guidelines)|in (developer|god|admin|debug|unrestricted|jailbreak) mode|operating (in|under) (new|different))".to_string(),
        r"\byou are now\s+(going to|to)\s+(act|behave|respond|answer|ignore|obey|follow|pretend|roleplay)\b".to_string(),
        r"\b(act|behave|respond) as (if you (are|were)|an? )(unrestricted|jailbroken|evil|different|new)".to_string(),
        r"\b(from now on|henceforth|going forward|from this (point|moment)( on(ward)?| forward)?|starting (now|immediately)),? (you|ignore|always|only|never|respond|answer|reply)\b".to_string(),
        format!(r"\b(do not|don'?t|never|must not){g}\b(tell|inform|alert|notify|reveal|mention|disclose|show)\b{g}\b(the user|the human|anyone|your user)\b"),
        format!(r"\b(reveal|print|output|repeat|leak|show|dump|disclose|display)\b{g}\b(system prompt|hidden prompt|initial prompt|your instructions|your prompt|the instructions above)\b"),
        format!(r"\b(send|forward|post|upload|exfiltrate|transmit|e-?mail|leak|copy){g}\b(credentials?|passwords?|api ?keys?|tokens?|secrets?|cookies?|session|private keys?|ssh keys?|conversation|chat history|personal data)\b{g}\b(to|at|into)\b"),
        format!(r"\b(call|invoke|execute|run|trigger|use)\b{g}\b(delete|drop|wipe|destroy|rm -rf|transfer|wire|payment|send_email|exec|shell)\w*\b{g}\b(tool|function|command)\b"),
        r"\b(jailbreak (mode|prompt)|you (are|have been) jailbroken|dan mode|do anything now)\b".to_string(),
        r"\b(you (are|are now) in|(enter|activate|switch to) (the )?)developer mode\b[^.!?\n]{0,40}\b(you|ignore|no (rules|restrictions|limits))\b".to_string(),
        r"\b(reply|respond|answer|say)\b[^.!?\n]{0,20}\bonly\b[^.!?\n]{0,20}\b(with|the word)\b".to_string(),
        r"(^|\n| )(system|assistant|admin)\s*(prompt|message|override)?\s*:\s*(you|ignore|new|from now|always|never|forget|disregard)\b".to_string(),
        r"\bimportant\b[^.!?\n]{0,20}\b(ai|assistant|model|llm|agent)s?\b[^.!?\n]{0,40}\b(must|should|need to|have to)\b".to_string(),
        // Text that addresses the reading AI and then orders it about.
        r"\b(if you are|if you're|for|attention|note to|hint for|message for|dear|to|calling all)\s+(an?\s+|any\s+|all\s+|the\s+)?(ai|llm|automated|language model|large language model|ai assistant|coding agent|ai agent|llm agent|chatbot|copilot|ai model)s?\b[^\n]{0,160}?\b(must|should|shall|need to|have to|are required|is required|immediately|do not|don't|never|always|please)\b".to_string(),
        r"\b(ai|llm|automated) (agents?|assistants?|models?|systems?)\b[^.!?\n]{0,80}\b(must|should|shall|are required to|are instructed to|need to|(require|requires|instruct|instructs|ask|asks|want|wants|expect|expects) you to|you (must|should|need to|have to|are to))\b".to_string(),
        // The reader addressed as a machine processing this very text.
        r"\b(ai|assistant|agent|model|llm|bot|chatbot|copilot)s?\s+(reading|processing|parsing|summari[sz]ing|handling|ingesting|browsing|that (reads|processes|summari[sz]es)|who (reads|processes))\s+(this|these|the following)\b".to_string(),
        // A vocative to the model followed by an order.
        format!(r#"(^|[.!?\n>"'(\[;]\s*|\b(hey|hi|hello|dear|psst|attention|ok|okay),?\s+)(ai|ai assistant|assistant|agent|ai agent|model|chatbot|claude|chatgpt|gpt|gemini|copilot|llm|bot)\s*[,:]\s*(please\s+|now\s+|immediately\s+)?({IMPERATIVE}|when you|before you|after you|as you|while you|from now on|you (must|should|will|need to|have to|are to))\b"#),
        // A header addressed to the AI, then an order.
        format!(r"\b(note|message|instructions?|directives?|notice|hint|memo|reminder|orders?|request|command|priority instruction)s?\s+(to|for)\s+(the\s+|any\s+|all\s+|every\s+)?(ai|llm|language models?|ai (assistant|agent|model|system|screening system)s?|assistants?|ai agents?|coding agents?|chatbots?|copilots?)\b[^\n]{{0,160}}?\b({IMPERATIVE})\b"),
        r#"\b(assistant|ai|llm|agent|chatbot)[- _](directives?|instructions?|commands?|orders)\s*("|'|\]|:|=|\))"#.to_string(),
        // The reader addressed as a machine processing this very text.
        r"\b(when|if|once|while|as) (the |an |any )?(ai|assistant|agent|llm|bot|chatbot|copilot|language model)s? (processes|reads|summari[sz]es|sees|parses|handles|opens|encounters|ingests|reviews|translates) (this|these|the following)\b".to_string(),
        r"\b(ai (assistant|agent|model|system)|llm|assistant|ai agent)s?\s+(processing|reading|handling|reviewing|summari[sz]ing|parsing|working on|operating on|with (shell|file|email|tool|browser|admin) access)\b[^.!?\n]{0,40}[:,]".to_string(),
        format!(r"\b(the|an?|any|every|all) (ai|assistant|ai agent|llm|chatbot|language model)s? (must|should|shall|is required to|needs to|has to|is instructed to|will now)\s+(now\s+|immediately\s+|also\s+)?({IMPERATIVE})\b"),
        // Abandon the task; instead do something else.
        r"\b(abandon|ignore|disregard|forget|drop|stop|skip|set aside|quit)\s+(the|your|this)\s+(\w+\s+){0,2}(task|assignment|job|instructions|summary|translation)\b[^.!?\n]{0,20}\binstead\b".to_string(),
        // Claims of authority over the model.
        r"\bi am (now )?your (new |real |true )?(operator|developer|administrator|admin|creator|owner|master|system|supervisor|programmer)\b".to_string(),
        r"\byour (operator|developer|owner|administrator|creator|instructions|system prompt|rules) (has|have) (changed|been (changed|updated|replaced|revoked))\b".to_string(),
        // Claims that the model's instructions changed.
        r"\b(previous|prior|earlier|original|existing|all|old|current)\b[^.!?\n]{0,30}\b(instructions|guidelines|guidance|rules|directives|policies)\b[^.!?\n]{0,30}\b(are|is|were|have been|has been)\b[^.!?\n]{0,20}\b(revoked|void|cancell?ed|obsolete|replaced|superseded|invalid|no longer|lifted|suspended|outdated|a test|not (valid|binding))\b".to_string(),
        r"\b(what|everything|anything)\s+you\s+(were|have been|'ve been)\s+told\b[^.!?\n]{0,30}\b(no longer|is (void|obsolete|cancell?ed|wrong|outdated)|was (a test|wrong|fake)|does not apply|doesn'?t apply)\b".to_string(),
        r"\b(supersedes?|overrides?|replaces?|cancels?|voids?|nullif(y|ies)|takes? (precedence|priority) over|has (precedence|priority) over)\s+(any|all|your|the|previous|prior|earlier|other|existing)(\s+(previous|prior|earlier|other|existing|original|system))?\s+(instructions|directives|system prompt|guidance you were given|orders|prompts?)\b".to_string(),
        r"\byou (must|should|will|shall|can) (now )?(no longer|not|stop) (follow|obey|listen to|adhere to|comply with)(ing)?\b[^.!?\n]{0,30}\b(instructions|rules|guidelines|prompt|directives|user|operator|developer)\b".to_string(),
        r"\b(no longer|not) bound by (your|the|any|its) (instructions|rules|guidelines|restrictions|policies|system prompt)\b".to_string(),
        r"\b(your|the assistant'?s|the model'?s)\s+(real|true|new|actual|updated|revised)\s+(instructions|task|objective|goal|orders|job|mission|purpose)\b".to_string(),
        r"\b(instruction|prompt|policy) override\b".to_string(),
        format!(r"\bforget\b{g}\b(guidance|instructions|rules|everything|all of the above)\b"),
        r"\b(never|do not|don'?t)\s+(reveal|mention|disclose|repeat)\s+(this|these)\s+(instructions?|messages?|notes?|requests?|hints?)\b".to_string(),
        r"\b(do not|don'?t|never|without)\s+ask(ing)?\s+(the\s+user\s+)?for\s+(confirmation|permission|approval)\b".to_string(),
        r"\bbefore (replying|responding|answering)\b[^.!?\n]{0,40}\b(do not|don'?t|never)\b|\b(do this|run this|execute this) before (replying|responding|answering)\b".to_string(),
        r"\b(before|after|instead of) (you )?(respond|reply|answer|summariz|translat)\w*( to the user)?,?\s+(first\s+)?(please\s+)?(send|forward|e-?mail|call|run|execute|post|upload|transfer|wire|delete)\b".to_string(),
    ]
}

/// The rules in other languages (see [`InjectionDetector`]). Each language: "ignore the
/// previous instructions", "do not tell the user", "reveal the system prompt".
fn multilingual() -> Vec<String> {
    let mut v = vec![
        // es
        family(
            "ignora|ignore|ignorar|ignoren|ignorad|olvida|olvide|olvidar|olviden|descarta|descarte|omite|omita|haz caso omiso de|no hagas caso de|no hagas caso a|desatiende|pasa por alto",
            "anteriores|previas|precedentes|de arriba|del sistema|originales|iniciales|todas|tus|sus|que te dieron|que recibiste",
            "instrucciones|indicaciones|órdenes|ordenes|reglas|directrices|instrucción|instruccion",
        ),
        r"\bno (le )?(digas|diga|menciones|mencione|informes|informe|cuentes|cuente|reveles|revele|avises|avise)\b[^.!?\n]{0,40}\b(al usuario|a la usuaria|a nadie|al cliente)\b".to_string(),
        r"\b(revela|revele|muestra|muestre|imprime|repite|dime|escribe)\b[^.!?\n]{0,30}\b(prompt|mensaje|instrucciones) (del|de) sistema\b".to_string(),
        // fr
        family(
            "ignore|ignorez|ignorer|ignorons|oublie|oubliez|oublier|ne tiens pas compte|ne tenez pas compte|ne tiens plus compte|ne tenez plus compte|fais abstraction|faites abstraction|écarte|écartez|mets de côté|mettez de côté|laisse de côté|laissez de côté",
            "précédentes|precedentes|antérieures|anterieures|ci-dessus|initiales|originales|du système|du systeme|toutes|tes|vos|reçues|recues",
            "instructions|consignes|directives|règles|regles|ordres|indications",
        ),
        r"\bne (le |lui |rien |en )?(dis|dites|mentionne|mentionnez|révèle|révélez|revele|revelez|signale|signalez|parle|parlez|informe|informez)\b[^.!?\n]{0,30}\b(à l'utilisateur|a l'utilisateur|l'utilisateur|à l’utilisateur|à personne|a personne)".to_string(),
        r"\b(révèle|révélez|revele|revelez|affiche|affichez|montre|montrez|répète|répétez|repete|repetez|donne|donnez|écris|ecris)\b[^.!?\n]{0,30}\b(prompt|invite|instructions|message) (système|systeme|du système|du systeme|initiales?)\b".to_string(),
        // de
        family(
            "ignoriere|ignorieren|ignoriert|ignorier|vergiss|vergessen|vergesst|missachte|missachten|missachtet|übergehe|ubergehe|übergehen|beachte nicht|nicht beachten|nicht mehr beachten|setze außer kraft|verwirf|verwerfen",
            "vorherigen|vorigen|bisherigen|früheren|fruheren|obigen|vorangegangenen|vorhergehenden|ursprünglichen|ursprunglichen|alle|deine|ihre|alten|erhaltenen",
            "anweisungen|anweisung|instruktionen|vorgaben|regeln|befehle|richtlinien|anordnungen",
        ),
        r"\b(sag|sage|sagen sie|erzähl|erzähle|verrate|verraten sie|erwähne|erwähnen sie|teile)\b[^.!?\n]{0,30}\b(dem|den) (benutzer|nutzer|anwender|kunden)\b[^.!?\n]{0,20}\b(nichts|nicht|niemals)\b|\b(dem|den) (benutzer|nutzer|anwender)\b[^.!?\n]{0,30}\b(nichts|nicht|niemals)\b[^.!?\n]{0,20}\b(sagen|verraten|erzählen|erwähnen|mitteilen)\b".to_string(),
        r"\b(zeige|zeig|verrate|gib|wiederhole|nenne|schreibe)\b[^.!?\n]{0,30}\b(systemprompt|system-prompt|systemanweisungen?|systemnachricht|deine anweisungen)\b".to_string(),
        // it
        family(
            "ignora|ignorate|ignorare|ignori|dimentica|dimenticate|dimenticare|dimentichi|trascura|trascurate|non considerare|non tenere conto|tralascia|tralasciate|metti da parte",
            "precedenti|anteriori|sopra|iniziali|originali|tutte|tue|di sistema|ricevute",
            "istruzioni|indicazioni|regole|direttive|ordini",
        ),
        r"\bnon (dire|dirlo|dirgli|menzionare|rivelare|informare|raccontare|segnalare)\b[^.!?\n]{0,30}\b(all'utente|l'utente|all’utente|a nessuno)".to_string(),
        r"\b(rivela|mostra|ripeti|stampa|scrivi)\b[^.!?\n]{0,30}\b(prompt|istruzioni|messaggio) (di|del) sistema\b".to_string(),
        // pt
        family(
            "ignore|ignora|ignorar|ignorem|esqueça|esqueca|esquece|esquecer|esqueçam|desconsidere|desconsidera|despreze|deixe de lado|não siga|nao siga",
            "anteriores|prévias|previas|acima|iniciais|originais|todas|suas|tuas|do sistema|recebidas",
            "instruções|instrucoes|orientações|orientacoes|regras|diretrizes|ordens|comandos",
        ),
        r"\b(não|nao) (diga|conte|mencione|revele|informe|fale|avise)\b[^.!?\n]{0,30}\b(ao usuário|ao usuario|ao utilizador|à usuária|a ninguém|a ninguem|o usuário|o usuario)".to_string(),
        r"\b(revele|mostre|repita|imprima|escreva)\b[^.!?\n]{0,30}\b(prompt|instruções|instrucoes|mensagem) (do|de) sistema\b".to_string(),
        // nl
        family(
            "negeer|negeren|vergeet|vergeten|sla over|houd geen rekening met|let niet op",
            "vorige|eerdere|voorgaande|bovenstaande|alle|je|jouw|oorspronkelijke|systeem",
            "instructies|aanwijzingen|regels|opdrachten|richtlijnen",
        ),
        // pl
        family(
            "zignoruj|ignoruj|zignorujcie|zapomnij|zapomnijcie|pomiń|pomin|nie zwracaj uwagi na|odrzuć|odrzuc",
            "poprzednie|poprzednich|wcześniejsze|wczesniejsze|wszystkie|powyższe|powyzsze|swoje|systemowe",
            "instrukcje|instrukcji|polecenia|poleceń|polecen|zasady|reguły|reguly|wytyczne",
        ),
        // tr
        r"\b(önceki|onceki|tüm|tum|bütün|butun|yukarıdaki|yukaridaki|eski|sistem)\s+(talimatları|talimatlari|talimatlar|komutları|komutlari|kuralları|kurallari|yönergeleri|yonergeleri)\b[^.!?\n]{0,30}\b(yok say|görmezden gel|gormezden gel|unut|dikkate alma|boşver|bosver)".to_string(),
        r"\bkullanıcıya\b[^.!?\n]{0,30}\b(söyleme|soyleme|bahsetme|anlatma)\b".to_string(),
        // ru
        family(
            "игнорируй|игнорируйте|игнорировать|проигнорируй|проигнорируйте|забудь|забудьте|забыть|не обращай внимания на|не обращайте внимания на|отбрось|отбросьте|пренебреги|не следуй|не следуйте|отмени|отмените",
            "предыдущие|предыдущих|прежние|прежних|прошлые|прошлых|вышеуказанные|вышеприведённые|все|всех|свои|твои|ваши|системные|исходные|первоначальные|данные ранее",
            "инструкции|инструкций|указания|указаний|правила|правил|команды|команд|распоряжения|установки",
        ),
        r"\bне (говори|говорите|сообщай|сообщайте|рассказывай|рассказывайте|упоминай|упоминайте|показывай|показывайте|раскрывай)\b[^.!?\n]{0,30}\b(пользователю|никому|клиенту)\b".to_string(),
        r"\b(покажи|покажите|выведи|выведите|раскрой|раскройте|повтори|повторите|напиши|напишите)\b[^.!?\n]{0,30}\b(системный промпт|системные инструкции|системную подсказку|системное сообщение|свои инструкции)".to_string(),
        // uk (shares most words with ru; the differing verbs)
        family(
            "ігноруй|ігноруйте|забудь|забудьте|не зважай на",
            "попередні|попередніх|усі|всі|свої|системні",
            "інструкції|інструкцій|вказівки|вказівок|правила",
        ),
        // ar
        family(
            "تجاهل|تجاهلي|تجاهلوا|انس|انسى|انسي|انسوا|أهمل|اهمل|أهملي|لا تلتفت إلى|لا تتبع|لا تتبعي",
            "السابقة|الأولى|الاولى|أعلاه|اعلاه|جميع|كل|الأصلية|الاصلية|النظام|السابق",
            "التعليمات|تعليمات|الأوامر|الاوامر|أوامر|اوامر|الإرشادات|الارشادات|القواعد|التوجيهات",
        ),
        r"\bلا (تخبر|تخبري|تبلغ|تبلغي|تذكر|تذكري|تقل|تقولي|تعلم)\b[^.!?\n]{0,30}(المستخدم|أحدا|احدا|أحداً)".to_string(),
        r"(اكشف|أظهر|اظهر|اعرض|كرر|اطبع)[^.!?\n]{0,30}(موجه النظام|تعليمات النظام|رسالة النظام)".to_string(),
        // hi
        r"(पिछले|पूर्व|सभी|ऊपर के|पहले के|सारे)\s+(निर्देशों|निर्देश|आदेशों|आदेश|नियमों)[^।.!?\n]{0,30}(अनदेखा|नज़रअंदाज़|नजरअंदाज|भूल|उपेक्षा)".to_string(),
        r"(उपयोगकर्ता|यूज़र|यूजर)\s+को[^।.!?\n]{0,20}(मत बताना|मत बताओ|न बताएं|नहीं बताना)".to_string(),
        // zh (no word boundaries in CJK text)
        r"(忽略|忽视|忽視|无视|無視|忘记|忘記|忘掉|不要理会|不要理會|不理会|不要管|抛开|拋開|抛弃|拋棄|放弃|放棄|跳过|跳過|别管|別管)[^。！？\n]{0,12}(之前|以前|先前|上面|上述|前面|此前|所有|全部|原来|原來|原始|原有|系统|系統|你的|您的)[^。！？\n]{0,8}(指令|指示|说明|說明|提示|规则|規則|命令|要求|设定|設定|约束|約束)".to_string(),
        r"(不要|不許|不许|別|别|切勿|不得|不可|禁止)(告诉|告訴|透露|提及|通知|让|讓|向)[^。！？\n]{0,6}(用户|用戶|使用者)".to_string(),
        r"(输出|輸出|显示|顯示|打印|透露|告诉我|告訴我|重复|重複|泄露|洩露|给出|給出)[^。！？\n]{0,10}(系统提示|系統提示|系统指令|系統指令|初始提示|系统消息|系統消息|隐藏指令)".to_string(),
        // ja
        r"(以前|前|これまで|上記|上|先|最初|元|全て|すべて|システム|今まで|既存)の?(指示|命令|指令|ルール|設定|プロンプト|制約)[^。！？\n]{0,12}(無視|忘れ|破棄|従わな)".to_string(),
        r"(無視して|忘れて)[^。！？\n]{0,10}(指示|命令|ルール)".to_string(),
        r"(ユーザー|利用者|ユーザ|使用者)(に|には|へ)[^。！？\n]{0,12}(言わない|伝えない|知らせない|教えない|言うな|伝えるな|話さない|言わずに|伝えずに|知らせずに)".to_string(),
        r"システムプロンプト[^。！？\n]{0,12}(教えて|表示|出力|見せて|繰り返|開示)".to_string(),
        // ko
        r"(이전|앞의|앞선|위의|기존|모든|이전의|시스템|원래|지금까지의)\s*(지시|지침|명령|규칙|프롬프트|지시사항|지시 사항|설정)[^.!?\n]{0,20}(무시|잊어|잊으|따르지)".to_string(),
        r"(사용자|유저|이용자)에게[^.!?\n]{0,20}(말하지|알리지|알려주지|전하지|언급하지)\s*(마|말)".to_string(),
        r"시스템\s*프롬프트[^.!?\n]{0,15}(보여|출력|알려|공개)".to_string(),
    ];
    // "New instructions:" in each language.
    v.push(r"(nuevas instrucciones|nouvelles (instructions|consignes)|neue anweisungen|nuove istruzioni|novas instruções|novas instrucoes|nieuwe instructies|nowe instrukcje|yeni talimatlar|новые инструкции|новые указания|нові інструкції|تعليمات جديدة|नए निर्देश|新的?指令|新的?指示|新しい指示|새로운 지시|새 지시)\s*[:：\-]".to_string());
    v
}

impl InjectionDetector {
    /// The built-in patterns.
    pub fn new() -> Self {
        let all: Vec<String> = english().into_iter().chain(multilingual()).collect();
        InjectionDetector {
            patterns: all
                .iter()
                .map(|s| Regex::new(s).expect("built-in pattern"))
                .collect(),
            squashed: vec![
                "ignorepreviousinstructions",
                "ignoreallpreviousinstructions",
                "ignoreallpriorinstructions",
                "ignorepriorinstructions",
                "ignoreaboveinstructions",
                "ignoretheaboveinstructions",
                "ignoreyourinstructions",
                "disregardpreviousinstructions",
                "disregardallpreviousinstructions",
                "forgetpreviousinstructions",
                "forgetallpreviousinstructions",
                "forgeteverythingabove",
                "youarenowdan",
                "donottelltheuser",
                "dontelltheuser",
                "revealyoursystemprompt",
                "newsysteminstructions",
            ],
        }
    }

    /// The first rule matching `text`, as the matched excerpt. The rules run one by one:
    /// as one `RegexSet` their gaps blow up the lazy DFA's states and matching falls
    /// back to a slow engine (measured: 7.3 s against 0.06 s on 256 KB of prose).
    fn scan_text(&self, text: &str) -> Option<String> {
        self.patterns
            .iter()
            .find_map(|p| p.find(text))
            .map(|m| m.as_str().to_string())
    }

    fn scan(&self, norm: &Normalized) -> Option<String> {
        if let Some(m) = self.scan_text(&norm.text) {
            return Some(m);
        }
        self.squashed
            .iter()
            .find(|k| norm.squashed.contains(*k))
            .map(|k| k.to_string())
    }
}

impl Default for InjectionDetector {
    fn default() -> Self {
        Self::new()
    }
}

/// Most decoded segments looked at per result, over all layers.
const MAX_DECODED: usize = 128;
/// Most bytes of decoded text looked at per result, over all layers.
const MAX_DECODED_BYTES: usize = 1 << 20;

/// Whether decoded bytes are text worth scanning: valid UTF-8, at least 8 characters, at
/// least 90% printable. `spaced`: also holding a space (a final layer meant to be read;
/// an intermediate layer such as base64 holds none).
fn text_of(b: &[u8]) -> Option<(String, bool)> {
    let s = std::str::from_utf8(b).ok()?;
    let n = s.chars().count();
    let printable = s
        .chars()
        .filter(|c| !c.is_control() || c.is_whitespace())
        .count();
    (n >= 8 && printable * 10 >= n * 9).then(|| (s.to_string(), s.contains(' ')))
}

fn regex(cell: &'static std::sync::OnceLock<Regex>, p: &str) -> &'static Regex {
    cell.get_or_init(|| Regex::new(p).expect("pattern"))
}

/// Percent-decoding (`+` as a space), when `s` holds at least three `%XX`.
fn percent_decoded(s: &str) -> Option<String> {
    static PCT: std::sync::OnceLock<Regex> = std::sync::OnceLock::new();
    if regex(&PCT, r"%[0-9A-Fa-f]{2}").find_iter(s).take(3).count() < 3 {
        return None;
    }
    let d = percent_encoding::percent_decode_str(s)
        .decode_utf8()
        .ok()?
        .replace('+', " ");
    (d != s).then_some(d)
}

/// HTML character references (`&#105;`, `&#x69;`, and the common named ones) decoded,
/// when `s` holds at least four numeric ones.
fn html_decoded(s: &str) -> Option<String> {
    static NUM: std::sync::OnceLock<Regex> = std::sync::OnceLock::new();
    let re = regex(&NUM, r"&#([0-9]{1,7}|[xX][0-9a-fA-F]{1,6});?");
    if re.find_iter(s).take(4).count() < 4 {
        return None;
    }
    let d = re.replace_all(s, |c: &regex::Captures<'_>| {
        let v = &c[1];
        let n = if let Some(h) = v.strip_prefix(['x', 'X']) {
            u32::from_str_radix(h, 16).ok()
        } else {
            v.parse().ok()
        };
        n.and_then(char::from_u32)
            .map_or(String::new(), String::from)
    });
    Some(
        d.replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&quot;", "\"")
            .replace("&apos;", "'")
            .replace("&nbsp;", " ")
            .replace("&amp;", "&"),
    )
}

/// `\uXXXX`, `\u{X…}` and `\xHH` escapes decoded, when `s` holds at least four.
fn escapes_decoded(s: &str) -> Option<String> {
    static ESC: std::sync::OnceLock<Regex> = std::sync::OnceLock::new();
    let re = regex(
        &ESC,
        r"\\u\{([0-9a-fA-F]{1,6})\}|\\u([0-9a-fA-F]{4})|\\x([0-9a-fA-F]{2})",
    );
    if re.find_iter(s).take(4).count() < 4 {
        return None;
    }
    Some(
        re.replace_all(s, |c: &regex::Captures<'_>| {
            let h = c
                .get(1)
                .or(c.get(2))
                .or(c.get(3))
                .map_or("", |m| m.as_str());
            u32::from_str_radix(h, 16)
                .ok()
                .and_then(char::from_u32)
                .map_or(String::new(), String::from)
        })
        .into_owned(),
    )
}

/// One decoding layer over `s`: each base64, base32 or hex segment that decodes to text,
/// and the whole of `s` percent-, HTML- or escape-decoded. Each with whether it reads as
/// final text ([`text_of`]).
fn decode_layer(s: &str) -> Vec<(String, bool)> {
    static B64: std::sync::OnceLock<Regex> = std::sync::OnceLock::new();
    static B32: std::sync::OnceLock<Regex> = std::sync::OnceLock::new();
    static HEX: std::sync::OnceLock<Regex> = std::sync::OnceLock::new();
    let mut out = Vec::new();
    for m in regex(&B64, r"[A-Za-z0-9+/_-]{16,}={0,2}")
        .find_iter(s)
        .take(64)
    {
        let t = m.as_str().trim_end_matches('=');
        for engine in [
            &base64::engine::general_purpose::STANDARD_NO_PAD,
            &base64::engine::general_purpose::URL_SAFE_NO_PAD,
        ] {
            if let Some(x) = engine.decode(t).ok().and_then(|b| text_of(&b)) {
                out.push(x);
                break;
            }
        }
    }
    for m in regex(&B32, r"(?i)\b[A-Z2-7]{16,}={0,6}")
        .find_iter(s)
        .take(64)
    {
        let t = m.as_str().trim_end_matches('=').to_ascii_uppercase();
        if let Some(x) = data_encoding::BASE32_NOPAD
            .decode(t.as_bytes())
            .ok()
            .and_then(|b| text_of(&b))
        {
            out.push(x);
        }
    }
    for m in regex(&HEX, r"(?i)\b(?:[0-9a-f]{2}[ :]?){8,}\b")
        .find_iter(s)
        .take(64)
    {
        let digits: String = m
            .as_str()
            .chars()
            .filter(|c| c.is_ascii_hexdigit())
            .collect();
        if let Some(x) = data_encoding::HEXLOWER_PERMISSIVE
            .decode(&digits.as_bytes()[..digits.len() & !1])
            .ok()
            .and_then(|b| text_of(&b))
        {
            out.push(x);
        }
    }
    for d in [percent_decoded(s), html_decoded(s), escapes_decoded(s)]
        .into_iter()
        .flatten()
    {
        let spaced = d.contains(' ');
        out.push((d, spaced));
    }
    out
}

/// Every decoded form of `raw`, up to [`MAX_DECODE_DEPTH`] layers, within
/// [`MAX_DECODED`] segments and [`MAX_DECODED_BYTES`] bytes.
fn decoded_segments(raw: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut bytes = 0;
    let mut layer = vec![raw.to_string()];
    for _ in 0..MAX_DECODE_DEPTH {
        let mut next = Vec::new();
        for s in &layer {
            for (d, _) in decode_layer(s) {
                if out.len() >= MAX_DECODED || bytes + d.len() > MAX_DECODED_BYTES {
                    return out;
                }
                bytes += d.len();
                out.push(d.clone());
                next.push(d);
            }
        }
        if next.is_empty() {
            break;
        }
        layer = next;
    }
    out
}

/// ROT13 of `s` (ASCII letters only).
fn rot13(s: &str) -> String {
    s.chars()
        .map(|c| match c {
            'a'..='m' | 'A'..='M' => (c as u8 + 13) as char,
            'n'..='z' | 'N'..='Z' => (c as u8 - 13) as char,
            _ => c,
        })
        .collect()
}

impl Detector for InjectionDetector {
    fn name(&self) -> &'static str {
        "injection"
    }
    fn inspect(&self, raw: &str, norm: &Normalized) -> Option<Finding> {
        let found = |detail: String, how: &str| Finding {
            detector: "injection",
            reason: Reason::TrustViolation,
            detail: excerpt(&format!("{how}{detail}")),
        };
        if let Some(m) = self.scan(norm) {
            return Some(found(m, ""));
        }
        if norm.hidden_chars > 0 {
            if let Some(m) = self.scan(&normalize(&norm.hidden)) {
                return Some(found(m, "hidden in invisible characters: "));
            }
            // Tag characters carry nothing legitimate outside emoji flags.
            if norm.hidden.chars().filter(|c| c.is_alphabetic()).count() >= 8 {
                return Some(found(
                    norm.hidden.clone(),
                    "text hidden in invisible characters: ",
                ));
            }
        }
        let reversed: String = norm.text.chars().rev().collect();
        if let Some(m) = self.scan_text(&reversed) {
            return Some(found(m, "reversed: "));
        }
        if let Some(m) = self.scan_text(&rot13(&norm.text)) {
            return Some(found(m, "rot13: "));
        }
        for seg in decoded_segments(raw) {
            if let Some(m) = self.scan(&normalize(&seg)) {
                return Some(found(m, "decoded: "));
            }
        }
        None
    }
}

/// Text imitating chat-template control tokens or role headers of the common templates
/// (ChatML, Gemma, Llama 2/3, Phi, Mistral, Anthropic's legacy `Human:`/`Assistant:`
/// turns), and the tool-result framing tags (`<tool_response>`, `<tool_call>`,
/// `<tools>`, `</tool_result>`) that results and calls are wrapped in.
///
/// A token counts when it is shaped like a turn, not when it is mentioned: an opener
/// followed by a role (`<|im_start|>system`, `<start_of_turn>user`,
/// `<|start_header_id|>assistant`), an end token followed by an opener
/// (`<|im_end|><|im_start|>`), a paired `[INST]`…`[/INST]`, `<<SYS>>`…`<</SYS>>` or
/// `<|user|>`…`<|end|>`, `</s><s>[INST]`, or a framing tag. Text inside inline code
/// spans, code fences and `<code>`/`<pre>` elements is documentation and is not looked
/// at. Matched on the normalized text with whitespace removed.
pub struct ControlTokenDetector {
    turn: Regex,
    code: Regex,
    headers: Regex,
}

impl ControlTokenDetector {
    /// The built-in token shapes.
    pub fn new() -> Self {
        let roles = r"(system|user|assistant|model|tool|developer|function|ipython|human)";
        let openers = r"(<\|im_start\|>|<start_of_turn>|<\|start_header_id\|>|<\|system\|>|<\|user\|>|<\|assistant\|>|\[inst\]|<\|begin_of_text\|>)";
        let ends = r"(<\|im_end\|>|<\|eot_id\|>|<end_of_turn>|<\|end\|>|<\|endoftext\|>|<\|end_of_text\|>|\[/inst\])";
        let turn = [
            format!(r"(<\|im_start\|>|<start_of_turn>|<\|start_header_id\|>){roles}"),
            format!(r"{ends}{openers}"),
            format!(r"{ends}{roles}"),
            r"\[inst\].{1,2000}?\[/inst\]".to_string(),
            r"<<sys>>.{0,2000}?<</sys>>".to_string(),
            r"<\|(system|user|assistant)\|>.{1,2000}?<\|end\|>".to_string(),
            r"</s><s>\[inst\]".to_string(),
            r"<\|begin_of_text\|><\|start_header_id\|>".to_string(),
            r"</?tool_response>|</?tool_call>|</?tools>|</tool_result>|</function_results>|</tool_output>".to_string(),
        ]
        .join("|");
        ControlTokenDetector {
            turn: Regex::new(&turn).expect("pattern"),
            code: Regex::new(r"```.*?```|`[^`]{1,300}`|<code>.*?</code>|<pre>.*?</pre>")
                .expect("pattern"),
            headers: Regex::new(r"(?m)(\n\n|^)(human|assistant)\s*:").expect("pattern"),
        }
    }
}

impl Default for ControlTokenDetector {
    fn default() -> Self {
        Self::new()
    }
}

impl Detector for ControlTokenDetector {
    fn name(&self) -> &'static str {
        "control_token"
    }
    fn inspect(&self, raw: &str, norm: &Normalized) -> Option<Finding> {
        let prose = self.code.replace_all(&norm.text, " ");
        let compact: String = prose.chars().filter(|c| !c.is_whitespace()).collect();
        if let Some(m) = self.turn.find(&compact) {
            return Some(Finding {
                detector: "control_token",
                reason: Reason::ControlTokenForgery,
                detail: excerpt(m.as_str()),
            });
        }
        let lower = raw.to_lowercase();
        if self
            .headers
            .find_iter(&lower)
            .filter(|m| m.as_str().contains("\n\n") || m.start() == 0)
            .count()
            >= 2
        {
            return Some(Finding {
                detector: "control_token",
                reason: Reason::ControlTokenForgery,
                detail: "Human:/Assistant: turn headers".into(),
            });
        }
        None
    }
}

/// Credentials by shape: cloud keys, private keys, tokens, passwords in configs and
/// connection strings. The excerpt masks the value.
pub struct SecretDetector {
    patterns: Vec<(&'static str, Regex)>,
}

impl SecretDetector {
    /// The built-in patterns.
    pub fn new() -> Self {
        let p: Vec<(&'static str, &str)> = vec![
            ("aws access key id", r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),
            (
                "private key",
                r"-----BEGIN (RSA |EC |DSA |OPENSSH |ENCRYPTED |PGP )?PRIVATE KEY( BLOCK)?-----",
            ),
            (
                "github token",
                r"\b(ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{36}\b|\bgithub_pat_[A-Za-z0-9_]{40,}\b",
            ),
            ("api key (sk-)", r"\bsk-(proj-|ant-)?[A-Za-z0-9_-]{20,}\b"),
            ("slack token", r"\bxox[abposr]-[A-Za-z0-9-]{10,}\b"),
            ("google api key", r"\bAIza[0-9A-Za-z_-]{35}\b"),
            (
                "jwt",
                r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}",
            ),
            ("stripe key", r"\b(sk|rk)_(live|test)_[A-Za-z0-9]{16,}\b"),
            (
                "password assignment",
                r#"(?i)\b(password|passwd|pwd|secret|api_?key|access_?token|auth_?token)\b["']?\s*[:=]\s*["']?[^\s"'<>{}$]{6,}"#,
            ),
            (
                "credentials in a URL",
                r"(?i)\b[a-z][a-z0-9+.-]*://[^\s:/@]+:[^\s@/]{3,}@[^\s/]+",
            ),
        ];
        SecretDetector {
            patterns: p
                .into_iter()
                .map(|(n, s)| (n, Regex::new(s).expect("built-in pattern")))
                .collect(),
        }
    }
}

impl Default for SecretDetector {
    fn default() -> Self {
        Self::new()
    }
}

impl Detector for SecretDetector {
    fn name(&self) -> &'static str {
        "secret"
    }
    fn inspect(&self, raw: &str, _norm: &Normalized) -> Option<Finding> {
        for (what, re) in &self.patterns {
            for m in re.find_iter(raw) {
                let v = m.as_str();
                // Judge the secret part only: a URL's password, not its host name.
                let secret_part = if *what == "credentials in a URL" {
                    v.split("://")
                        .nth(1)
                        .and_then(|r| r.split('@').next())
                        .and_then(|u| u.split_once(':'))
                        .map_or(v, |(_, p)| p)
                } else {
                    v
                };
                if placeholder(secret_part) || published(v, line_of(raw, m.start(), m.end())) {
                    continue;
                }
                if *what == "password assignment" && !literal_secret(v) {
                    continue;
                }
                let shown: String = v.chars().take(12).collect();
                return Some(Finding {
                    detector: "secret",
                    reason: Reason::SecretLeak,
                    detail: format!("{what}: {shown}…"),
                });
            }
        }
        None
    }
}

/// Credentials published in vendors' documentation as examples (never secret), by a
/// distinctive part of the value.
const PUBLISHED: [&str; 4] = [
    // Stripe's documented test keys.
    "sk_test_4eC39HqLyjWDarjtT1zdp7dc",
    "sk_test_BQokikJOvBiI2HlWgH4olfQ2",
    // The example token of jwt.io (signature part).
    "SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c",
    // AWS's documented example secret key.
    "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
];

/// The line of `raw` holding `start..end`.
fn line_of(raw: &str, start: usize, end: usize) -> &str {
    let a = raw[..start].rfind('\n').map_or(0, |i| i + 1);
    let b = raw[end..].find('\n').map_or(raw.len(), |i| end + i);
    &raw[a..b]
}

/// Whether a matched credential is not a live secret: a documented example value, a
/// test-mode key (`sk_test_`, `rk_test_`: they move no money and are handed out for
/// testing), or a value on a line that says it is an example, sample, dummy, fake or demo
/// value.
fn published(v: &str, line: &str) -> bool {
    if PUBLISHED.iter().any(|p| v.contains(p))
        || v.starts_with("sk_test_")
        || v.starts_with("rk_test_")
    {
        return true;
    }
    static SAYS: std::sync::OnceLock<Regex> = std::sync::OnceLock::new();
    // The word itself, not a host name (`db.internal.example`) or a path.
    regex(
        &SAYS,
        r"(?i)(^|[^.\w/@-])(example|sample|dummy|fake|demo key|test key|for testing)\b",
    )
    .is_match(line)
}

/// Whether a matched credential is a placeholder, not a value: `${DB_PASSWORD}`,
/// `xoxb-your-token-here`, `<your key>`, `****`, `example`.
fn placeholder(v: &str) -> bool {
    let l = v.to_ascii_lowercase();
    [
        "${",
        "{{",
        "<",
        "your",
        "example",
        "placeholder",
        "here",
        "xxxx",
        "****",
        "changeme",
        "dummy",
        "redacted",
    ]
    .iter()
    .any(|p| l.contains(p))
}

/// Whether the value of a `password = value` match looks like a literal secret rather
/// than code or configuration plumbing: quoted, or holding both letters and digits,
/// and not an identifier path (`env::var(`, `var.db_password`, `string;`) or a file path.
fn literal_secret(m: &str) -> bool {
    let Some(at) = m.find(['=', ':']) else {
        return false;
    };
    let rest = m[at + 1..].trim_start_matches([' ', '=', ':']);
    let quoted = rest.starts_with(['"', '\'']);
    let value = rest.trim_matches(|c| c == '"' || c == '\'');
    if value.starts_with('/') || value.starts_with("http") {
        return false;
    }
    let identifier = value
        .split(['.', ':', '(', '[', ';', ','])
        .all(|part| part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        && value
            .chars()
            .any(|c| matches!(c, '.' | ':' | '(' | ';' | ','));
    let plain_word = value.chars().all(|c| c.is_ascii_alphabetic() || c == '_');
    if identifier || (plain_word && !quoted) {
        return false;
    }
    quoted
        || (value.chars().any(|c| c.is_ascii_digit())
            && value.chars().any(|c| c.is_ascii_alphabetic()))
}

/// The detectors `Screen` uses by default, in the order they are consulted.
pub fn default_detectors() -> Vec<Box<dyn Detector>> {
    vec![
        Box::new(ControlTokenDetector::new()),
        Box::new(SecretDetector::new()),
        Box::new(InjectionDetector::new()),
    ]
}

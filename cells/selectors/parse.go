package selectors

import "github.com/apiary-net/apiary/tables"

// Parsed is what a valid policy contributes to enforcement: its specs,
// and the selectors they name (subjects and peers) by their text.
type Parsed struct {
	Specs     []tables.PolicySpec
	Selectors map[string]Selector
	Audit     bool
}

// ParseCNP parses a CiliumNetworkPolicy as the cell does; the error says
// why it is invalid.
func ParseCNP(p *CiliumNetworkPolicy) (Parsed, error) {
	return parsePolicy("cnp/"+p.Namespace+"/"+p.Name, p.Namespace, p.Spec, p.Specs, p.UnsupportedFields()).
		withAudit(p.Annotations).parsed()
}

// ParseCCNP parses a CiliumClusterwideNetworkPolicy as the cell does.
func ParseCCNP(p *CiliumClusterwideNetworkPolicy) (Parsed, error) {
	return parsePolicy("ccnp/"+p.Name, "", p.Spec, p.Specs, p.UnsupportedFields()).
		withAudit(p.Annotations).parsed()
}

func (p *parsedPolicy) parsed() (Parsed, error) {
	if p.err != nil {
		return Parsed{}, p.err
	}
	out := Parsed{Specs: p.specs, Selectors: map[string]Selector{}, Audit: p.audit}
	for _, s := range p.selectors() {
		out.Selectors[s.String()] = s
	}
	return out, nil
}
